"""What gateway replicas tell each other: placements and in-flight bookings.

Each replica is a :class:`~cachepilot.core.router.Router` with its own state. Without
talking, a replica knows only the prefixes it placed itself and, until the next scrape, only
its own requests in flight: behind a Service that spreads clients at random, a prefix's
requests are split across replicas and each places it on its own guess.

:class:`ReplicaSync` is a lifecycle plugin that turns this replica's lifecycle into small
events (:class:`Placed`, :class:`Prefilled`, :class:`Finished`) in an outbox, and applies the
other replicas' events to its pools: their placements enter the directory, their bookings
count in flight and as pending prefill, exactly like its own, until their first token or
finish. Transport is the adapter's business (a message bus, the simulator's event queue); it
may lose or delay events, so every remote booking expires after ``booking_ttl_s``, and each
replica's periodic :class:`InFlight` heartbeat (the ids it still has in flight) ends the
bookings whose end was lost within one heartbeat; a replica that falls silent has its
bookings dropped after ``silent_after_s`` (bounded staleness). The scrape stays the truth for
queues. Nothing here waits for a peer: a slow or
absent bus only means less shared knowledge.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cachepilot.core.lifecycle import Outcome, Plugin

if TYPE_CHECKING:
    from cachepilot.core.decision import Decision
    from cachepilot.core.pool import Pool
    from cachepilot.core.router import Router


@dataclass(frozen=True, slots=True)
class Placed:
    """A replica routed request ``id`` to ``worker``: the worker will hold ``hashes`` and
    has ``uncached_tokens`` of its prefill to do."""

    replica: str
    id: str
    pool: str
    worker: str
    hashes: tuple[int, ...]
    uncached_tokens: int
    kind: str = "placed"
    # The hashes are the approximate scheme's (the request fell back from an exact pool's
    # engine hashes): routing-learned only, never pending (Decision.fallback).
    approximate: bool = False


@dataclass(frozen=True, slots=True)
class Prefilled:
    """Request ``id``'s first token came back: its prefill no longer queues ahead."""

    replica: str
    id: str
    kind: str = "prefilled"


@dataclass(frozen=True, slots=True)
class Finished:
    """Request ``id`` no longer occupies its worker."""

    replica: str
    id: str
    kind: str = "finished"


@dataclass(frozen=True, slots=True)
class InFlight:
    """Every request ``replica`` still has in flight, as of this point in its stream: the
    others end any booking of its that is not listed (its Finished was lost)."""

    replica: str
    ids: tuple[str, ...]
    kind: str = "inflight"


SyncEvent = Placed | Prefilled | Finished | InFlight
_KINDS: dict[str, type] = {"placed": Placed, "prefilled": Prefilled, "finished": Finished,
                           "inflight": InFlight}


def event_to_dict(e: SyncEvent) -> dict[str, Any]:
    if isinstance(e, Placed):
        out = {"kind": e.kind, "replica": e.replica, "id": e.id, "pool": e.pool,
               "worker": e.worker, "hashes": list(e.hashes),
               "uncached_tokens": e.uncached_tokens}
        if e.approximate:
            out["approximate"] = True
        return out
    if isinstance(e, InFlight):
        return {"kind": e.kind, "replica": e.replica, "ids": list(e.ids)}
    return {"kind": e.kind, "replica": e.replica, "id": e.id}


def event_from_dict(d: dict[str, Any]) -> SyncEvent:
    """The inverse of :func:`event_to_dict`; ValueError for anything else."""
    try:
        cls = _KINDS[d["kind"]]
        if cls is Placed:
            return Placed(str(d["replica"]), str(d["id"]), str(d["pool"]), str(d["worker"]),
                          tuple(int(h) for h in d["hashes"]), int(d["uncached_tokens"]),
                          approximate=bool(d.get("approximate", False)))
        if cls is InFlight:
            if not isinstance(d["ids"], list):
                raise TypeError("ids is not a list")
            return InFlight(str(d["replica"]), tuple(str(i) for i in d["ids"]))
        return cls(str(d["replica"]), str(d["id"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a sync event: {exc!r}") from None


@dataclass(slots=True)
class _Booking:
    pool: str
    worker: str
    uncached_tokens: int
    expires: float
    prefill_pending: bool = True


@dataclass
class ReplicaSync(Plugin):
    """This replica's side of the exchange. Drive it from the router's thread: the adapter
    drains :attr:`outbox` to the bus and feeds received events to :meth:`apply`."""

    replica: str
    booking_ttl_s: float = 30.0
    # A replica whose heartbeats stopped this long ago is gone (or cut off from us): its
    # bookings are dropped. Only for replicas that sent a heartbeat at all.
    silent_after_s: float = 5.0
    outbox: list[SyncEvent] = field(default_factory=list)
    max_outbox: int = 10_000  # a bus that is down must not grow memory without bound
    applied: int = 0
    expired: int = 0
    dropped: int = 0  # outbox overflow: events this replica never sent
    history: int = 20_000  # own recent placements kept for a joining replica's catch-up
    _remote: dict[tuple[str, str], _Booking] = field(default_factory=dict)
    _recent: deque[Placed] = field(default_factory=deque)
    _open: set[str] = field(default_factory=set)  # own requests not finished yet
    _heard: dict[str, float] = field(default_factory=dict)  # replica → its last heartbeat

    # -- this replica's lifecycle -------------------------------------------------------------
    def _emit(self, e: SyncEvent) -> None:
        if len(self.outbox) >= self.max_outbox:
            self.dropped += 1
            return
        self.outbox.append(e)

    def on_routed(self, decision: Decision, pool: Pool) -> None:
        e = Placed(self.replica, decision.id, decision.pool, decision.chosen, decision.hashes,
                   decision.uncached_tokens, approximate=decision.fallback is not None)
        self._emit(e)
        self._recent.append(e)
        self._open.add(e.id)
        while len(self._recent) > self.history:
            self._open.discard(self._recent.popleft().id)

    def on_first_token(self, decision: Decision, ttft_ms: float | None) -> None:
        self._emit(Prefilled(self.replica, decision.id))

    def on_finish(self, decision: Decision, outcome: Outcome) -> None:
        self._emit(Finished(self.replica, decision.id))
        self._open.discard(decision.id)

    def snapshot(self) -> list[SyncEvent]:
        """What a joining replica needs from this one: its recent placements (for the
        directory), each followed by its end if it has ended (so only the requests still in
        flight stay booked there)."""
        out: list[SyncEvent] = []
        for e in self._recent:
            out.append(e)
            if e.id not in self._open:
                out.append(Finished(self.replica, e.id))
        return out

    def heartbeat(self) -> None:
        """Put this replica's in-flight ids in the outbox (the adapter calls it every
        second or so, and on reconnecting)."""
        self._emit(InFlight(self.replica, tuple(self._open)))

    def drain(self) -> list[SyncEvent]:
        out, self.outbox = self.outbox, []
        return out

    # -- the other replicas' ------------------------------------------------------------------
    def apply(self, e: SyncEvent, router: Router, now: float, live: bool = True) -> None:
        """Apply another replica's event (this replica's own are ignored). ``live`` off for
        a catch-up snapshot: its placements are history, not arrivals now."""
        if e.replica == self.replica:
            return
        if isinstance(e, InFlight):
            self._reconcile(e, router, now)
            self.applied += 1
            return
        key = (e.replica, e.id)
        if isinstance(e, Placed):
            pool = router.pools.get(e.pool)
            w = None if pool is None else pool.workers.get(e.worker)
            if pool is None or w is None or key in self._remote:
                return
            pool.directory.insert(e.worker, e.hashes, learned_only=e.approximate)
            # The pool's arrival rate prices congestion: it must count every replica's
            # arrivals, or each of N replicas sees a burst at 1/N of its rate.
            if live:
                pool.note_arrival(now, e.uncached_tokens)
            w.inflight += 1
            w.pending_requests += 1
            w.pending_prefill_tokens += e.uncached_tokens
            self._remote[key] = _Booking(e.pool, e.worker, e.uncached_tokens,
                                         now + self.booking_ttl_s)
        else:
            b = self._remote.get(key)
            if b is None:
                return
            self._end_prefill(b, router)
            if isinstance(e, Finished):
                self._release(key, router)
        self.applied += 1

    def _reconcile(self, e: InFlight, router: Router, now: float) -> None:
        self._heard[e.replica] = now
        live = set(e.ids)
        for k in [k for k in self._remote if k[0] == e.replica and k[1] not in live]:
            self._end_prefill(self._remote[k], router)
            self._release(k, router)
            self.expired += 1

    def expire(self, router: Router, now: float) -> int:
        """Drop remote bookings older than their TTL (their end was lost), and those of
        replicas silent for ``silent_after_s``; how many."""
        silent = {r for r, t in self._heard.items() if now - t >= self.silent_after_s}
        old = [k for k, b in self._remote.items() if b.expires <= now or k[0] in silent]
        for k in old:
            self._end_prefill(self._remote[k], router)
            self._release(k, router)
        self.expired += len(old)
        return len(old)

    def remote_bookings(self) -> int:
        return len(self._remote)

    def _worker(self, b: _Booking, router: Router) -> Any:
        pool = router.pools.get(b.pool)
        return None if pool is None else pool.workers.get(b.worker)

    def _end_prefill(self, b: _Booking, router: Router) -> None:
        if not b.prefill_pending:
            return
        b.prefill_pending = False
        w = self._worker(b, router)
        if w is not None:
            w.pending_requests = max(0, w.pending_requests - 1)
            w.pending_prefill_tokens = max(0, w.pending_prefill_tokens - b.uncached_tokens)

    def _release(self, key: tuple[str, str], router: Router) -> None:
        b = self._remote.pop(key)
        w = self._worker(b, router)
        if w is not None and w.inflight > 0:
            w.inflight -= 1
