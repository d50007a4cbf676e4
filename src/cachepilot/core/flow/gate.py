"""The gate: which workers may take a request now.

A worker is *open* while the requests waiting at it beyond its batch stay under
``hold_depth`` (0: while its batch has a free place); *closed* at or above it; *unusable*
when it is not ready or its metrics are missing or stale. Waiting is the worker's occupancy
(this gateway's requests there it has not seen finish, plus the others the last scrape
saw) beyond the batch size when that is known (configured ``max_batch``, the engine's, or a
slot engine's slots). Without it, only the scraped queue counts (less this gateway's
requests that finished since), a worker closes at 2 waiting, and the gate can let one
scrape interval's worth through before it sees a queue: configure ``max_batch`` (vLLM does
not export ``max_num_seqs``) for a tight gate.

Why tight (default 0: a request goes only into a free place of a batch of known size): a
worker's own queue is first come, first served, so any request that waits there has already
been ordered; only what the gateway still holds can be ordered by priority and fairness
(llm-d's guide advises a queue-depth threshold of 1–5 "for maximum fairness/control").
"""

from __future__ import annotations

from cachepilot.core.cost import CostModel
from cachepilot.core.pool import Pool
from cachepilot.core.workers import WorkerState

CLOSED = "closed"  # the candidate filter a closed worker gets in a decision
UNKNOWN_BATCH_DEPTH = 2  # the gate's depth at a worker whose batch size nobody said


def queued(w: WorkerState, now: float, cost: CostModel) -> int | None:
    """Requests waiting at ``w`` beyond its batch as this gateway believes, negative when
    its batch has free places (as many as that); None when the worker is unusable (not
    ready, unobserved, stale).

    With a known batch size, the engine's occupancy now is this gateway's own requests there
    that it has not seen finish (live), plus the others the last scrape saw (its occupancy
    beyond what this gateway had in flight when the scrape was stored): a scrape up to an
    interval old would otherwise keep a worker closed after its batch freed places, or open
    after a burst filled it; a finish counts when the gateway sees it, so a worker closes a
    moment early rather than late. A scrape that saw requests waiting with the KV cache past
    the cost model's threshold says the batch it saw running is as large as memory allows.
    Without a known batch size, free places are unknown: the scraped queue, less this
    gateway's requests that finished since (they were in it or ahead of it), never
    negative."""
    m = w.metrics
    if not w.ready or m is None or now - m.scraped_at > cost.stale_after_s:
        return None
    cap = batch_size(w, cost)
    if not cap:
        return max(0, m.waiting - max(0, m.router_inflight - w.inflight))
    if m.waiting and (m.kv_usage or 0.0) >= cost.kv_threshold:
        cap = min(cap, m.running)  # KV memory binds before the batch size: this is the batch
    foreign = max(0, m.waiting + m.running - m.router_inflight)
    return foreign + w.inflight - cap


def batch_size(w: WorkerState, cost: CostModel) -> int:
    """The worker's batch size if someone said it (configured ``max_batch``, the engine's,
    a slot engine's slots); 0 unknown. Never the size learned from scrapes: a gate that
    held requests back would never let the batch grow past a small first guess."""
    m = w.metrics
    return cost.max_batch or (0 if m is None else m.max_batch or m.slots or 0)


class Gate:
    """Our gate (per worker, ``hold_depth``). Another scheduler's model (the simulator's
    llm-d flow control) may subclass it: :meth:`split` and :meth:`is_open` are all flow
    control asks."""

    def __init__(self, hold_depth: int) -> None:
        self.hold_depth = hold_depth

    def split(self, pool: Pool, now: float) -> tuple[list[str], list[str]]:
        """(open, closed) workers of ``pool``; the rest are unusable."""
        cost = pool.spec.cost
        opened: list[str] = []
        closed: list[str] = []
        for addr, w in pool.workers.items():
            q = queued(w, now, cost)
            if q is None:
                continue
            (opened if q < self._limit(w, cost) else closed).append(addr)
        return opened, closed

    def is_open(self, pool: Pool, addr: str, now: float) -> bool:
        """Whether one worker is open (the fast path asks only about the router's pick)."""
        w = pool.workers.get(addr)
        if w is None:
            return False
        q = queued(w, now, pool.spec.cost)
        return q is not None and q < self._limit(w, pool.spec.cost)

    def _limit(self, w: WorkerState, cost: CostModel) -> int:
        # No known batch size: free places are unknown, and a scrape under load often
        # catches a request or two between steps; a worker closes at 2 waiting then.
        return (self.hold_depth if batch_size(w, cost)
                else max(self.hold_depth, UNKNOWN_BATCH_DEPTH))

