"""What flow control adds to a routing decision (and so to its record): how long the request
was held and why, where it stood in the queue, and how its dispatch was chosen.

No imports from the rest of the core: :mod:`cachepilot.core.decision` refers to it."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# Why a request was held.
POOL_FULL = "pool_full"  # no worker was open when it arrived
HOLDER_BUSY = "prefix_holder_busy"  # waiting for the busy worker holding its prefix was cheaper
QUEUED_BEHIND = "queued_behind"  # others were already held in its pool (order is fairness's)
HOLD_REASONS = (POOL_FULL, HOLDER_BUSY, QUEUED_BEHIND)

# How it was dispatched.
DIRECT = "direct"  # never held
FAIR = "fair"  # the fair pick (least-served eligible tenant, oldest request)
LOCALITY = "locality"  # a locality pick that displaced the fair one
HOLDER = "holder"  # it waited for its prefix holder and got it
HOLDER_TIMEOUT = "holder_timeout"  # it waited for its prefix holder, then went elsewhere
DISPATCH_REASONS = (DIRECT, FAIR, LOCALITY, HOLDER, HOLDER_TIMEOUT)

# Why a request was refused (429 unless said otherwise).
QUEUE_FULL = "queue_full"  # its band was full and its tenant held the most of it
OVER_SHARE = "tenant_over_share"  # pushed out of a full band: its tenant held the most
TTL_EXPIRED = "ttl_expired"  # held for the band's time to live
SHEDDABLE = "sheddable"  # sheddable and would have waited
SLO_UNMEETABLE = "slo_unmeetable"  # sheddable, and no worker was predicted to meet its SLO
NO_READY_WORKER = "no_ready_worker"  # 503: nothing could ever serve it
SHED_REASONS = (QUEUE_FULL, OVER_SHARE, TTL_EXPIRED, SHEDDABLE, SLO_UNMEETABLE, NO_READY_WORKER)
CANCELLED = "cancelled"  # the client left while held (not a shed: nobody is answered)

# The response header a refusal carries (llm-d sends x-llm-d-request-dropped-reason).
SHED_HEADER = "x-cachepilot-shed-reason"


@dataclass(slots=True)
class FlowInfo:
    """A decision's flow-control fields (``Decision.flow``; ``"flow"`` in its record)."""

    tenant: str
    priority: int
    held_ms: float = 0.0
    hold_reason: str | None = None  # one of HOLD_REASONS; None when never held
    position: int = 0  # requests ahead of it in its band and above when it was queued
    queued_at_dispatch: int = 0  # requests still held in its pool when it left
    dispatch: str = DIRECT  # one of DISPATCH_REASONS
    lag_tokens: float = 0.0  # its tenant's counter minus the band's least, at dispatch
    gain_ms: float = 0.0  # prefill ms the locality pick saved over the fair pick
    charged_tokens: float = 0.0  # weighted tokens charged to its tenant at dispatch
    estimated_output: int = 0  # the output tokens that charge assumed
    objective: str | None = None
    slo_ms: float | None = None
    slo_met: bool | None = None  # the predictor said the chosen worker meets the SLO
    holder: str | None = None  # the busy prefix holder it waited for

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}
