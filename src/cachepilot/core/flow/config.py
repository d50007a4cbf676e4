"""Flow control's settings: one frozen value, shared by the gateway, the operator's pools,
the simulator and the chart (which all default to these numbers)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

# Scheduling within a band: ``fair`` (weighted-token fair shares with bounded locality
# bending, ours), ``fcfs`` (one FIFO across tenants: holding without fairness).
FAIRNESS_MODES = ("fair", "fcfs")

# The inference extension's request headers (and llm-d's newer names, which llm-d prefers;
# pkg/epp/metadata/consts.go keeps the x-gateway-* ones as aliases).
FAIRNESS_HEADERS = ("x-gateway-inference-fairness-id", "x-llm-d-inference-fairness-id")
OBJECTIVE_HEADERS = ("x-gateway-inference-objective", "x-llm-d-inference-objective")
# Agent session headers llm-d's agent-identity plugin reads, in its order
# (pkg/epp/framework/plugins/requestcontrol/requestheader/agentidentity).
SESSION_HEADERS = ("x-claude-code-session-id", "x-session-affinity", "session-id", "session_id")
PRIORITY_HEADER = "x-cachepilot-priority"
SLO_HEADER = "x-cachepilot-ttft-slo-ms"
DEFAULT_TENANT = "default"


@dataclass(frozen=True, slots=True)
class FlowConfig:
    """Every flow-control knob. Defaults are what `cachepilot gateway` runs with."""

    enabled: bool = True
    # -- the gate: a worker closes at this many requests waiting beyond its batch (0: once
    # its batch is full, when its size is known; else as 1).
    hold_depth: int = 0
    # -- bounds, per band (priority): queued requests, and seconds a request may be held.
    # Envoy's request timeout (30 s in the generated config) must outlast the TTL.
    max_queued: int = 1000
    ttl_s: float = 20.0
    # Negative priorities (sheddable): held at most this long; 0 sheds them as soon as they
    # would wait (the default: shed first and early).
    sheddable_ttl_s: float = 0.0
    # -- fairness within a band.
    fairness: str = "fair"
    input_weight: float = 1.0  # weighted tokens per prompt token
    output_weight: float = 2.0  # ...per output token (VTC's and llm-d LAS's 1:2)
    half_life_s: float = 60.0  # counters decay (llm-d LAS's default); 0: never
    # How far locality may bend fairness: a tenant is eligible while its counter is within
    # this many weighted tokens of the least-served backlogged tenant's (0: strict VTC order).
    bend_tokens: float = 2048.0
    lookahead: int = 8  # requests fairness allows that locality chooses among
    locality_gain_ms: float = 10.0  # prefill ms a locality pick must save over the fair one
    # A request waits for the busy worker holding its prefix when placing it there costs at
    # least this much less, queue included, than on an open worker (the router's price in
    # ms: the first token, and the delay its prefill adds to later arrivals); for as long
    # as waiting can still pay (the open worker's price less the holder's own for it), and
    # never longer than holder_wait_ms (0: never), a backstop against a wrong prediction.
    holder_gain_ms: float = 50.0
    holder_wait_ms: float = 5000.0
    # Output tokens a request is charged at dispatch when it sets no max_tokens and its tenant
    # has no history; completions correct the charge when the worker reports usage.
    default_output_tokens: int = 256
    # -- what a request says about itself (header names are lower case).
    tenant_header: str = FAIRNESS_HEADERS[0]
    sessions_as_tenants: bool = True  # an agent session header names the tenant if none does
    priority_header: str = PRIORITY_HEADER
    slo_header: str = SLO_HEADER
    # Tenants with their own metric labels (the first seen); the others share "other".
    metric_tenants: int = 20

    def __post_init__(self) -> None:
        if self.fairness not in FAIRNESS_MODES:
            raise ValueError(f"fairness is one of {', '.join(FAIRNESS_MODES)}, "
                             f"not {self.fairness!r}")
        for name in ("max_queued", "lookahead"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.hold_depth < 0:
            raise ValueError("hold_depth must not be negative")
        for name in ("ttl_s", "sheddable_ttl_s", "half_life_s", "bend_tokens",
                     "locality_gain_ms", "holder_gain_ms", "holder_wait_ms", "input_weight",
                     "output_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")

    def ttl(self, priority: int) -> float:
        """How long a request of this band may be held."""
        return self.sheddable_ttl_s if priority < 0 else self.ttl_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_(self, **changes: Any) -> FlowConfig:
        return replace(self, **changes)


# Settings a "name=value,…" string may change (the CLI's --flow, the chart's values).
_NUMERIC = tuple(f.name for f in fields(FlowConfig)
                 if isinstance(getattr(FlowConfig(), f.name), int | float)
                 and not isinstance(getattr(FlowConfig(), f.name), bool))
_TEXT = ("fairness", "tenant_header", "priority_header", "slo_header")
_FLAGS = ("sessions_as_tenants",)


def parse_flow(text: str | None) -> dict[str, Any]:
    """``"hold_depth=2,ttl_s=10,fairness=fcfs"`` → the changes to :class:`FlowConfig`; a
    ValueError names what was expected. Integer settings stay integers."""
    out: dict[str, Any] = {}
    defaults = FlowConfig()
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, value = part.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or name not in (*_NUMERIC, *_TEXT, *_FLAGS):
            raise ValueError(f"bad flow setting {part!r}: expected NAME=VALUE with NAME one of "
                             f"{', '.join(sorted((*_NUMERIC, *_TEXT, *_FLAGS)))}")
        if name in _TEXT:
            out[name] = value.lower() if name.endswith("header") else value
        elif name in _FLAGS:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"bad flow setting {part!r}: {value!r} is not true or false")
            out[name] = value.lower() in ("true", "1")
        else:
            try:
                number = float(value)
            except ValueError:
                raise ValueError(f"bad flow setting {part!r}: {value!r} is not a number") from None
            if isinstance(getattr(defaults, name), int):
                if not number.is_integer():
                    raise ValueError(f"bad flow setting {part!r}: {value!r} is not a whole "
                                     "number")
                number = int(number)
            out[name] = number
    return out
