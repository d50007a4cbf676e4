"""The gate: which workers may take a request now.

A worker is *open* while the requests waiting at it beyond its batch stay under
``hold_depth``; *closed* at or above it; *unusable* when it is not ready or its metrics are
missing or stale. Waiting counts the last scrape's queue plus the requests this gateway sent
since that the batch cannot have taken: the requests it has in flight beyond what the scrape
saw, minus the batch's free places when the batch size is known (configured ``max_batch``,
the engine's, a slot engine's slots, or the largest batch seen while requests waited). Until
it is known, requests sent since the scrape are assumed to fit in the batch, so the gate can
let one scrape interval's worth through before it sees a queue; a configured ``max_batch``
makes it tight from the first request.

Why tight (default 2): a worker's own queue is first come, first served, so any request
that waits there has already been ordered; only what the gateway still holds can be ordered
by priority and fairness (llm-d's guide advises a queue-depth threshold of 1–5 "for maximum
fairness/control").
"""

from __future__ import annotations

from cachepilot.core.cost import CostModel
from cachepilot.core.pool import Pool
from cachepilot.core.workers import WorkerState

CLOSED = "closed"  # the candidate filter a closed worker gets in a decision


def queued(w: WorkerState, now: float, cost: CostModel) -> int | None:
    """Requests waiting at ``w`` beyond its batch, as this gateway believes; None when the
    worker is unusable (not ready, unobserved, stale)."""
    m = w.metrics
    if not w.ready or m is None or now - m.scraped_at > cost.stale_after_s:
        return None
    unseen = w.inflight - m.waiting - m.running
    if unseen <= 0:
        return m.waiting
    cap = cost.max_batch or m.max_batch or m.slots or w.batch_cap_seen
    if not cap:
        return m.waiting
    return m.waiting + max(0, unseen - max(0, cap - m.running))


class Gate:
    """Our gate (per worker, ``hold_depth``). Another scheduler's model (the simulator's
    llm-d flow control) may subclass it: :meth:`split` is all flow control asks."""

    def __init__(self, hold_depth: int) -> None:
        self.hold_depth = hold_depth

    def split(self, pool: Pool, now: float) -> tuple[list[str], list[str]]:
        """(open, closed) workers of ``pool``; the rest are unusable."""
        depth, cost = self.hold_depth, pool.spec.cost
        opened: list[str] = []
        closed: list[str] = []
        for addr, w in pool.workers.items():
            q = queued(w, now, cost)
            if q is None:
                continue
            (opened if q < depth else closed).append(addr)
        return opened, closed
