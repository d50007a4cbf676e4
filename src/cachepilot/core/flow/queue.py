"""Held requests: one queue per pool, a band per priority, a FIFO per tenant in a band.

A :class:`Ticket` is one held request; whoever admitted it is told through ``on_done`` when
it leaves the queue (dispatched with a decision, refused with an error, or cancelled). The
queue also keeps the pool's fair-share counters and its recent dispatch rate (for
Retry-After), so everything about one pool's waiting lives in one object.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

from cachepilot.core.decision import Candidate, Decision
from cachepilot.core.fingerprint import Fingerprint
from cachepilot.core.flow.classify import FlowMeta
from cachepilot.core.flow.config import FlowConfig
from cachepilot.core.flow.fair import Counters
from cachepilot.core.request import InferenceRequest, RequestError

QUEUED, DISPATCHED, REFUSED, CANCELLED = "queued", "dispatched", "refused", "cancelled"


@dataclass(eq=False, slots=True)
class Ticket:
    """One held request and, once it has left the queue, how it left."""

    seq: int
    meta: FlowMeta
    request: InferenceRequest
    pool: str
    fp: Fingerprint
    cost: float  # weighted tokens its tenant is charged at dispatch
    est_output: int  # output tokens that charge assumes
    enqueued: float
    deadline: float  # when its time to live runs out
    reason: str  # why it was held (cachepilot.core.flow.info.HOLD_REASONS)
    position: int = 0  # requests ahead of it in its band and above when queued
    only: Collection[str] | None = None  # the proxy's subset hint
    started: float | None = None  # perf_counter() when its driver began (decision latency)
    holder: str | None = None  # a busy prefix holder it waits for…
    holder_until: float = 0.0  # …until then
    holder_gain_ms: float = 0.0
    holder_priced: Candidate | None = None  # the holder as priced when the hold began…
    holder_since: float = 0.0  # …then
    state: str = QUEUED
    decision: Decision | None = None
    error: RequestError | None = None
    on_done: Callable[[Ticket], None] | None = None

    @property
    def key(self) -> tuple[int, str]:
        return (self.meta.priority, self.meta.tenant)


class Band:
    """The held requests of one priority, a FIFO per tenant (in arrival order)."""

    def __init__(self, priority: int) -> None:
        self.priority = priority
        self.tenants: dict[str, deque[Ticket]] = {}
        self.count = 0

    def __iter__(self) -> Iterator[Ticket]:
        for q in self.tenants.values():
            yield from q


class PoolQueue:
    """One pool's held requests, its fair-share counters and its dispatch rate."""

    RATE_WINDOW_S = 5.0

    def __init__(self, name: str, config: FlowConfig) -> None:
        self.name = name
        self.config = config  # the pool's flow-control settings
        self.bands: dict[int, Band] = {}
        self.order: list[int] = []  # priorities with a band, highest first
        self.count = 0
        self.counters = Counters(config.half_life_s)
        self.holding: set[Ticket] = set()  # held ones waiting for their prefix holder
        # Per band, the counter of the tenant dispatched last, as it started (the band's
        # virtual time, as in start-time fair queueing): where a tenant that becomes
        # backlogged in an otherwise idle band starts, so a newcomer cannot claim service
        # for the time it was not there. Off: VTC's lift, to backlogged tenants only.
        self.lift_to_virtual = True
        self._virtual: dict[int, tuple[float, float]] = {}
        self._rate = 0.0  # dispatches per second (EWMA)
        self._rate_at = 0.0

    def __bool__(self) -> bool:
        return self.count > 0

    def ahead(self, priority: int) -> int:
        """Requests held in this band and the ones above it."""
        return sum(b.count for p, b in self.bands.items() if p >= priority)

    def band(self, priority: int) -> Band:
        b = self.bands.get(priority)
        if b is None:
            b = self.bands[priority] = Band(priority)
            self.order = sorted(self.bands, reverse=True)
        return b

    def add(self, t: Ticket, now: float) -> None:
        """Queue ``t`` behind its tenant's other requests. A tenant that becomes backlogged
        has its counter lifted to the least among those already backlogged (VTC), or, with
        none, to the band's virtual time."""
        b = self.band(t.meta.priority)
        q = b.tenants.get(t.meta.tenant)
        if q is None:
            if b.tenants:
                floor = self.counters.least(((b.priority, x) for x in b.tenants), now)
                self.counters.lift(t.key, floor, now)
            elif self.lift_to_virtual:
                self.counters.lift(t.key, self.virtual(b.priority, now), now)
            q = b.tenants[t.meta.tenant] = deque()
        t.position = self.ahead(t.meta.priority)
        q.append(t)
        b.count += 1
        self.count += 1

    def remove(self, t: Ticket) -> bool:
        """Take ``t`` out wherever it is (a head when dispatched, anywhere when its client
        left); False if it was not queued."""
        b = self.bands.get(t.meta.priority)
        q = None if b is None else b.tenants.get(t.meta.tenant)
        if q is None:
            return False
        self.holding.discard(t)
        if q and q[0] is t:
            q.popleft()
        else:
            try:
                q.remove(t)
            except ValueError:
                return False
        if not q:
            del b.tenants[t.meta.tenant]  # type: ignore[union-attr]
        b.count -= 1  # type: ignore[union-attr]
        self.count -= 1
        if not b.count:  # type: ignore[union-attr]
            del self.bands[t.meta.priority]
            self.order = sorted(self.bands, reverse=True)
        return True

    def longest_tenant(self, priority: int) -> tuple[str, int] | None:
        """The tenant holding most of a band, and how many."""
        b = self.bands.get(priority)
        if not b:
            return None
        tenant, q = max(b.tenants.items(), key=lambda kv: len(kv[1]))
        return tenant, len(q)

    def expired(self, now: float) -> list[Ticket]:
        """Requests whose time to live ran out (heads of their FIFOs: a tenant's requests
        expire in arrival order, as a band's TTL is one number)."""
        out: list[Ticket] = []
        for b in self.bands.values():
            for q in b.tenants.values():
                for t in q:
                    if t.deadline > now:
                        break
                    out.append(t)
        return out

    def next_deadline(self, now: float) -> float:
        """When, after ``now``, the next request expires or stops waiting for its prefix
        holder (those whose wait is over are forgotten here)."""
        self.holding = {t for t in self.holding if t.holder_until > now}
        soonest = min((t.holder_until for t in self.holding), default=math.inf)
        for b in self.bands.values():
            for q in b.tenants.values():
                soonest = min(soonest, q[0].deadline)
        return soonest

    def virtual(self, priority: int, now: float) -> float:
        """The band's virtual time (decayed as the counters are)."""
        v = self._virtual.get(priority)
        if v is None:
            return 0.0
        value, at = v
        h = self.counters.half_life_s
        return value if h <= 0 or now <= at else value * math.exp2(-(now - at) / h)

    def serve(self, priority: int, tenant: str, cost: float, now: float, *,
              lift: bool = False) -> None:
        """A request of ``tenant`` is dispatched: its tenant is charged ``cost`` (lifted to
        the band's virtual time first, with ``lift``), and the band's virtual time becomes
        its counter as the request started."""
        floor = self.virtual(priority, now) if lift and self.lift_to_virtual else 0.0
        start = self.counters.serve((priority, tenant), floor, cost, now)
        self._virtual[priority] = (start, now)

    # -- dispatch rate (Retry-After) ------------------------------------------------------
    def rate(self, now: float) -> float:
        return self._rate * math.exp(-max(0.0, now - self._rate_at) / self.RATE_WINDOW_S)

    def note_dispatch(self, now: float) -> None:
        self._rate = self.rate(now) + 1.0 / self.RATE_WINDOW_S
        self._rate_at = max(now, self._rate_at)

    def retry_after_s(self, priority: int, now: float, ttl_s: float) -> float:
        """Seconds until a retry may find room: the requests ahead of a newcomer of this
        band over the recent dispatch rate, between 1 s and the band's time to live."""
        rate = self.rate(now)
        ahead = self.ahead(priority)
        wait = ahead / rate if rate > 0.05 else ttl_s
        return float(min(max(1, math.ceil(wait)), max(1, math.ceil(ttl_s))))
