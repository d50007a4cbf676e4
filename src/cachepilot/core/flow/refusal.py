"""Refusals: the error a request gets when flow control will not hold it any longer, with a
reason a client (and `cachepilot explain`, and the metrics) can act on, and Retry-After."""

from __future__ import annotations

from cachepilot.core.decision import RoutingError
from cachepilot.core.flow import info as fi
from cachepilot.core.flow.classify import FlowMeta
from cachepilot.core.flow.config import FlowConfig
from cachepilot.core.flow.queue import PoolQueue


class FlowError(RoutingError):
    """A refusal by flow control: ``reason`` is one of info.SHED_REASONS (it becomes the
    response's x-cachepilot-shed-reason header)."""

    def __init__(self, status: int, message: str, reason: str, *,
                 retry_after_s: float | None = None) -> None:
        super().__init__(status, message, code=f"flow_{reason}", retry_after_s=retry_after_s)
        self.reason = reason


def refusal(q: PoolQueue, meta: FlowMeta, reason: str, now: float,
            cfg: FlowConfig) -> FlowError:
    """The error for refusing a request of ``meta``'s band in ``q``'s pool: 503 when no
    worker is ready (nothing could serve it), else 429 with a Retry-After from the band's
    backlog and recent dispatch rate."""
    if reason == fi.NO_READY_WORKER:
        return FlowError(503, f"pool {q.name!r} has no ready worker", reason,
                         retry_after_s=1.0)
    ttl = cfg.ttl(meta.priority) or cfg.ttl_s
    retry = q.retry_after_s(meta.priority, now, ttl)
    p, tenant = meta.priority, meta.tenant
    text = {
        fi.QUEUE_FULL: f"the queue of band {p} is full ({cfg.max_queued} requests held) and "
                       f"tenant {tenant!r} already holds the most of it",
        fi.OVER_SHARE: f"pushed out of the full queue of band {p}: tenant {tenant!r} held the "
                       "most of it",
        fi.TTL_EXPIRED: f"held {ttl:g} s (band {p}'s time to live) without a worker free to "
                        "take it",
        fi.SHEDDABLE: f"sheddable request (priority {p}) shed: every worker is busy or others "
                      "are waiting",
        fi.SLO_UNMEETABLE: "sheddable request shed: no worker is predicted to meet its TTFT "
                           f"target of {meta.slo_ms or 0:g} ms",
    }[reason]
    return FlowError(429, f"{text}; retry in {retry:.0f} s", reason, retry_after_s=retry)
