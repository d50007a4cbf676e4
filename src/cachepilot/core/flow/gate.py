"""The gate: which workers may take a request now.

A worker is *open* while the requests waiting at it beyond its batch stay under
``hold_depth`` (0: while its batch has a free place); *closed* at or above it; *unusable*
when it is not ready or its metrics are missing or stale. Waiting is the worker's occupancy
(this gateway's requests there it has not seen finish, plus the others the last scrape
saw) beyond the batch size when that is known (configured ``max_batch``, the engine's, a
slot engine's slots, or the largest batch seen while requests waited). Until it is known,
only the scraped queue counts, so the gate can let one scrape interval's worth through
before it sees a queue; a configured ``max_batch`` makes it tight from the first request.

Why tight (default 0: a request goes only into a free place of a batch, when the batch
size is known; 1 otherwise): a worker's own queue is first come, first served, so any
request that waits there has already been ordered; only what the gateway still holds can be
ordered by priority and fairness (llm-d's guide advises a queue-depth threshold of 1–5
"for maximum fairness/control").
"""

from __future__ import annotations

from cachepilot.core.cost import CostModel
from cachepilot.core.pool import Pool
from cachepilot.core.workers import WorkerState

CLOSED = "closed"  # the candidate filter a closed worker gets in a decision


def queued(w: WorkerState, now: float, cost: CostModel) -> int | None:
    """Requests waiting at ``w`` beyond its batch as this gateway believes, negative when
    its batch has free places (as many as that); None when the worker is unusable (not
    ready, unobserved, stale).

    The engine's occupancy now is this gateway's own requests there that it has not seen
    finish (live), plus the others the last scrape saw (someone else's: its occupancy
    beyond what this gateway had in flight when the scrape was stored). A scrape up to an
    interval old would otherwise keep a worker closed after its batch freed places, or
    open after a burst filled it; a finish is counted when the gateway sees it, so a worker
    closes a moment early rather than late. A scrape that saw requests waiting with the KV
    cache past the cost model's threshold says the batch it saw running is as large as
    memory allows, whatever its nominal size. Without a known batch size, free places are
    unknown: the scraped queue alone, never negative."""
    m = w.metrics
    if not w.ready or m is None or now - m.scraped_at > cost.stale_after_s:
        return None
    cap = cost.max_batch or m.max_batch or m.slots or w.batch_cap_seen
    if not cap:
        return m.waiting
    if m.waiting and (m.kv_usage or 0.0) >= cost.kv_threshold:
        cap = min(cap, m.running)  # KV memory binds before the batch size: this is the batch
    foreign = max(0, m.waiting + m.running - m.router_inflight)
    return foreign + w.inflight - cap


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
            # No known batch size: free places are unknown, so depth 0 behaves as 1.
            limit = depth if depth > 0 or _capped(w, cost) else 1
            (opened if q < limit else closed).append(addr)
        return opened, closed


def _capped(w: WorkerState, cost: CostModel) -> bool:
    m = w.metrics
    return bool(cost.max_batch or (m is not None and (m.max_batch or m.slots))
                or w.batch_cap_seen)
