"""What a request says about itself to flow control: its tenant, its priority band, its TTFT
target, from its headers (and, in Kubernetes, the InferenceObjective it names)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from cachepilot.core.flow.config import (
    DEFAULT_TENANT,
    FAIRNESS_HEADERS,
    OBJECTIVE_HEADERS,
    SESSION_HEADERS,
    FlowConfig,
)
from cachepilot.core.request import RequestError

MAX_TENANT_CHARS = 128  # a tenant id is a label value and a log field: keep it short


@dataclass(frozen=True, slots=True)
class FlowMeta:
    """A request's place in flow control."""

    tenant: str = DEFAULT_TENANT
    priority: int = 0  # the band; negative = sheddable
    objective: str | None = None  # the InferenceObjective it named, if any
    slo_ms: float | None = None  # its TTFT target, if it gave one

    @property
    def sheddable(self) -> bool:
        return self.priority < 0


DEFAULT_META = FlowMeta()


def header_names(cfg: FlowConfig) -> tuple[str, ...]:
    """Every request header :func:`classify` may read (Envoy forwards these to the gateway
    as ext_proc attributes when it does not send the headers themselves)."""
    names = [cfg.tenant_header, *FAIRNESS_HEADERS, *OBJECTIVE_HEADERS, cfg.priority_header,
             cfg.slo_header]
    if cfg.sessions_as_tenants:
        names += SESSION_HEADERS
    return tuple(dict.fromkeys(n.lower() for n in names))


def classify(headers: Mapping[str, str], cfg: FlowConfig,
             objectives: Mapping[str, int] | None = None) -> FlowMeta:
    """The request's tenant, band and TTFT target. ``headers`` has lower-case names.

    Tenant: the configured header, else the inference extension's fairness id (either
    name), else an agent session header (``sessions_as_tenants``), else ``default``.
    Priority: the named InferenceObjective's (``objectives``: name → priority, watched by the
    operator; an unknown objective is priority 0, as in llm-d), else the plain priority
    header, else 0. A priority or SLO header that is not a number is the client's error."""
    if not headers:
        return DEFAULT_META
    tenant = headers.get(cfg.tenant_header) or next(
        (headers[h] for h in FAIRNESS_HEADERS if headers.get(h)), None)
    if not tenant and cfg.sessions_as_tenants:
        tenant = next((headers[h] for h in SESSION_HEADERS if headers.get(h)), None)
    tenant = (tenant or DEFAULT_TENANT).strip()[:MAX_TENANT_CHARS] or DEFAULT_TENANT
    objective = next((headers[h] for h in OBJECTIVE_HEADERS if headers.get(h)), None)
    priority = 0
    if objective is not None:
        priority = (objectives or {}).get(objective, 0)
    elif (raw := headers.get(cfg.priority_header)) is not None:
        try:
            priority = int(raw.strip())
        except ValueError:
            raise RequestError(400, f"header {cfg.priority_header} must be an integer "
                                    f"priority, not {raw!r}") from None
    slo = None
    if (raw := headers.get(cfg.slo_header)) is not None:
        try:
            slo = float(raw.strip())
        except ValueError:
            slo = math.nan
        if not math.isfinite(slo) or slo <= 0:
            raise RequestError(400, f"header {cfg.slo_header} must be a positive number of "
                                    f"milliseconds, not {raw!r}")
    return FlowMeta(tenant=tenant, priority=priority, objective=objective, slo_ms=slo)
