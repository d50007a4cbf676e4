"""Flow control's driver-facing object: admit a request (dispatch it now, hold it, or refuse
it), pump the queues when capacity frees, cancel a request whose client left.

:class:`FlowControl` wraps a :class:`~cachepilot.core.router.Router`: it decides *whether and
when* a request is routed, the router still decides *where* (the priced pick, with flow
control's closed workers excluded but valued). Everything runs on the caller's clock and
thread: the gateway calls :meth:`FlowControl.pump` from one asyncio task whenever a capacity
event kicks it (:class:`FlowPlugin`: a first token, a finish; the scraper: a scrape; a
timer: the next deadline), the simulator after each event. The fast path, nothing held in
the pool and no worker closed, is the router's own route plus one gate check.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import NamedTuple

from cachepilot.core.decision import Candidate, Decision, RoutingError
from cachepilot.core.fingerprint import Fingerprint
from cachepilot.core.flow import info as fi
from cachepilot.core.flow.classify import FlowMeta
from cachepilot.core.flow.config import FlowConfig
from cachepilot.core.flow.gate import CLOSED
from cachepilot.core.flow.info import FlowInfo
from cachepilot.core.flow.observe import FlowObserver, FlowPlugin
from cachepilot.core.flow.pick import locality_pick
from cachepilot.core.flow.queue import DISPATCHED, REFUSED, PoolQueue, Ticket
from cachepilot.core.flow.refusal import FlowError
from cachepilot.core.flow.slo import Unmeetable, meet_slo
from cachepilot.core.flow.state import FlowState
from cachepilot.core.pool import Pool
from cachepilot.core.request import InferenceRequest, RequestError

__all__ = ["FlowControl", "FlowError", "FlowObserver", "FlowPlugin"]

# (reason, holder, holder_until, gain_ms, the holder as priced then)
_Hold = tuple[str, str | None, float, float, Candidate | None]


class FlowControl(FlowState):
    """Holds, orders and releases one router's requests (one queue per pool)."""

    # -- admission ----------------------------------------------------------------------------
    def admit(self, req: InferenceRequest, meta: FlowMeta, now: float, *,
              only: Collection[str] | None = None, started: float | None = None,
              on_done: Callable[[Ticket], None] | None = None) -> Decision | Ticket:
        """Route ``req`` now (a Decision), or hold it (a Ticket: ``on_done`` is called when it
        leaves the queue later), or refuse it (raises RequestError, already reported to the
        router's plugins)."""
        router = self.router
        try:
            pool, fp = router.prepare(req)
        except RequestError as err:
            router.reject(err, req, now)
            raise
        q = self._queue(pool)
        cfg = q.config
        if not cfg.enabled:  # flow control is off for this pool: the router alone
            try:
                d = router.decide(pool, req.model, fp, now, router.next_id(), req, only=only)
            except RequestError as err:
                router.reject(err, req, now)
                raise
            return router.book(d, pool, fp, req, now, started)
        est = self.estimates.estimate(meta.tenant, req.max_tokens)
        cost = self._cost(cfg, fp.tokens, est)
        if q:
            hold: _Hold = (fi.QUEUED_BEHIND, None, 0.0, 0.0, None)
        else:
            now_or_hold = self._try_now(pool, q, req, fp, meta, now, only, started, cost, est)
            if isinstance(now_or_hold, Decision):
                return now_or_hold
            hold = now_or_hold
        if meta.sheddable and cfg.ttl(meta.priority) <= 0:
            raise self._report_new(q, req, meta, self._error(q, meta, fi.SHEDDABLE, now), now)
        reason, holder, until, gain, priced = hold
        self._seq += 1
        t = Ticket(self._seq, meta, req, pool.name, fp, cost, est, now,
                   self.deadline(cfg, now, meta.priority), reason, only=only,
                   holder=holder, holder_until=until, holder_gain_ms=gain,
                   holder_priced=priced, holder_since=now)
        self._make_room(q, t, now)
        q.add(t, now)
        if holder is not None:
            q.holding.add(t)
        for o in self.observers:
            o.on_held(t, now)
        if reason == fi.QUEUED_BEHIND:
            self._pump_pool(q, now, self.arrival_limit)
        if t.state == DISPATCHED:  # it went at once: the caller gets its decision…
            assert t.decision is not None
            return t.decision
        if t.state == REFUSED:  # …or its refusal, and on_done is never called
            assert t.error is not None
            raise t.error
        t.on_done = on_done
        return t

    @staticmethod
    def _holder_wait_s(cfg: FlowConfig, priority: int, wait: _HolderWait) -> float:
        """How long a request may wait for its busy prefix holder: until waiting can no
        longer pay (:func:`_holder_gain`'s break-even), never beyond holder_wait_ms; 0 when it
        may not (the predicted gain is below holder_gain_ms, or its band is never held)."""
        if (wait.gain_ms < cfg.holder_gain_ms or cfg.holder_wait_ms <= 0
                or cfg.ttl(priority) <= 0):
            return 0.0
        return min(wait.break_even_ms, cfg.holder_wait_ms) / 1000.0

    def deadline(self, cfg: FlowConfig, now: float, priority: int) -> float:
        """When a request of this band held from ``now`` runs out of time to live."""
        return now + cfg.ttl(priority)

    def _try_now(self, pool: Pool, q: PoolQueue, req: InferenceRequest, fp: Fingerprint,
                 meta: FlowMeta, now: float, only: Collection[str] | None,
                 started: float | None, cost: float, est: int) -> Decision | _Hold:
        """Nothing is held in the pool: route at once if an open worker should take it,
        else say why it waits. The fast path, the router's own pick landing on an open
        worker, checks that one worker alone: the cost of flow control when nothing waits."""
        cfg = q.config
        gate = self._gate_of(q)
        try:
            d = self.router.decide(pool, req.model, fp, now, self.router.next_id(), req,
                                   only=only)
        except RoutingError:
            d = None  # the full path below says why, and reports it
        if d is not None and gate.is_open(pool, d.chosen, now):
            return self._direct(pool, q, d, req, fp, meta, now, only, None, started, cost, est)
        opened, closed = gate.split(pool, now)
        if only is not None:
            opened = [w for w in opened if w in only]
            closed = [w for w in closed if w in only]
        if not opened:
            limit = pool.spec.cost.admission_limit
            # Every worker past the admission limit (someone else floods the engines, or the
            # metrics say so): holding cannot help soon; the router answers 429 at once, as
            # without flow control. Nothing ready: the router answers 503.
            past_limit = bool(closed) and all(
                (m := pool.workers[w].metrics) is not None and m.waiting >= limit
                for w in closed)
            if not past_limit and (closed or self._any_ready(pool, only)):
                return (fi.POOL_FULL, None, 0.0, 0.0, None)
        excluded = dict.fromkeys(closed, CLOSED) if closed else None
        try:
            d = self.router.decide(pool, req.model, fp, now, self.router.next_id(), req,
                                   only=only, excluded=excluded)
        except RoutingError as err:
            if err.status == 429 and opened:  # open by the gate, yet full or stale
                return (fi.POOL_FULL, None, 0.0, 0.0, None)
            self.router.reject(err, req, now)
            raise
        if closed:
            wait = _holder_gain(d)
            wait_s = self._holder_wait_s(cfg, meta.priority, wait)
            if wait.holder is not None and wait_s > 0:
                return (fi.HOLDER_BUSY, wait.holder, now + wait_s, wait.gain_ms, wait.priced)
        return self._direct(pool, q, d, req, fp, meta, now, only, excluded, started, cost, est)

    def _direct(self, pool: Pool, q: PoolQueue, d: Decision, req: InferenceRequest,
                fp: Fingerprint, meta: FlowMeta, now: float, only: Collection[str] | None,
                excluded: dict[str, str] | None, started: float | None, cost: float,
                est: int) -> Decision:
        """Route ``d`` at once (its TTFT target heeded), never held."""
        try:
            d, met = meet_slo(self.router, pool, d, req, fp, meta, now, only, excluded, 0.0)
        except Unmeetable:
            err = self._error(q, meta, fi.SLO_UNMEETABLE, now)
            raise self._report_new(q, req, meta, err, now) from None
        info = FlowInfo(meta.tenant, meta.priority, objective=meta.objective,
                        slo_ms=meta.slo_ms, slo_met=met, charged_tokens=cost,
                        estimated_output=est)
        return self._book(pool, q, d, req, fp, info, now, started, cost, direct=True)

    # -- dispatch -----------------------------------------------------------------------------
    def pump(self, now: float, limit: int = 0) -> int:
        """Expire what outlived its time to live, then dispatch held requests while workers
        are open (at most ``limit`` per pool; 0: no limit). Returns how many went."""
        n = 0
        for q in [q for q in self.queues.values() if q]:
            n += self._pump_pool(q, now, limit)
        return n

    def _pump_pool(self, q: PoolQueue, now: float, limit: int = 0) -> int:
        pool = self.router.pools.get(q.name)
        for t in q.expired(now) if pool is not None else list(_all(q)):
            q.remove(t)
            why = fi.TTL_EXPIRED if pool is not None and self._any_ready(pool, t.only) \
                else fi.NO_READY_WORKER
            self._refuse(q, t, why, now)
        n = 0
        if pool is not None:
            self._queue(pool)  # its settings as the pool's spec says now
        while q and pool is not None and (not limit or n < limit):
            opened, closed = self._gate_of(q).split(pool, now)
            if not opened or not self._dispatch_one(pool, q, opened, closed, now):
                break
            n += 1
        return n

    def _dispatch_one(self, pool: Pool, q: PoolQueue, opened: list[str], closed: list[str],
                      now: float) -> bool:
        """Dispatch the next request fairness and locality choose, of the highest band that
        has one an open worker can take; False if none can go now."""
        closed_set = frozenset(closed)

        def usable(t: Ticket) -> bool:
            return not (t.holder is not None and t.holder in closed_set and now < t.holder_until)

        for priority in q.order:
            band = q.bands[priority]
            cands = self._picker_of(q).candidates(q, band, now, usable)
            if not cands:
                continue
            order, gain = locality_pick(pool, cands, opened, q.config.locality_gain_ms)
            for i, t in enumerate(order):
                if self._try_dispatch(pool, q, t, opened, closed, now,
                                      gain if i == 0 else 0.0):
                    return True
        return False

    def _try_dispatch(self, pool: Pool, q: PoolQueue, t: Ticket, opened: list[str],
                      closed: list[str], now: float, gain: float) -> bool:
        """Route ``t`` if it should go now (False: it waits, for an open worker of its
        subset or for its busy prefix holder). ``gain``: the prefill ms a locality pick of
        ``t`` saves over the fair pick (0: it is the fair pick)."""
        started = time.perf_counter()
        if t.only is not None and not any(w in t.only for w in opened):
            return False
        excluded = dict.fromkeys(closed, CLOSED) if closed else None
        try:
            d = self.router.decide(pool, t.request.model, t.fp, now, self.router.next_id(),
                                   t.request, only=t.only, excluded=excluded)
        except RoutingError:
            return False  # nothing open it may use (its subset): it waits
        if closed and t.holder is None:
            wait = _holder_gain(d)
            wait_s = self._holder_wait_s(q.config, t.meta.priority, wait)
            if wait.holder is not None and wait_s > 0:
                t.holder, t.holder_until = wait.holder, now + wait_s
                t.holder_gain_ms = wait.gain_ms
                t.holder_priced, t.holder_since = wait.priced, now
                t.reason = fi.HOLDER_BUSY
                q.holding.add(t)
                return False
        elif t.holder is not None and t.holder in closed and self._wait_on(q, t, d, now):
            return False
        held_ms = (now - t.enqueued) * 1000.0
        lag = self._picker_of(q).lag(q, t, now)
        q.remove(t)
        try:
            d, met = meet_slo(self.router, pool, d, t.request, t.fp, t.meta, now, t.only,
                              excluded, held_ms)
        except Unmeetable:
            self._refuse(q, t, fi.SLO_UNMEETABLE, now)
            return True
        m = t.meta
        dispatch = (fi.LOCALITY if gain > 0 else fi.FAIR if t.holder is None
                    else fi.HOLDER if d.chosen == t.holder else fi.HOLDER_TIMEOUT)
        info = FlowInfo(m.tenant, m.priority, held_ms=held_ms, hold_reason=t.reason,
                        position=t.position, queued_at_dispatch=q.count, dispatch=dispatch,
                        lag_tokens=lag, gain_ms=gain, charged_tokens=t.cost,
                        estimated_output=t.est_output, objective=m.objective, slo_ms=m.slo_ms,
                        slo_met=met, holder=t.holder)
        if dispatch == fi.HOLDER and t.holder_priced is not None:
            d.holder_priced = t.holder_priced
            d.holder_waited_ms = (now - t.holder_since) * 1000.0
        self._book(pool, q, d, t.request, t.fp, info, now, started, t.cost)
        self._finish(q, t, DISPATCHED, now, decision=d)
        return True

    def _wait_on(self, q: PoolQueue, t: Ticket, d: Decision, now: float) -> bool:
        """``t``'s wait for its busy holder ran out: wait on if the holder has moved since
        the hold began (its queue, as the router prices it now from what the engine reports,
        is shorter: its prefill done, say, and only a short decode left) and waiting still
        pays at today's price; never beyond holder_wait_ms from the hold's start. A queue
        that has not moved is the guess the wait already outlived: the request goes (the
        break-even's bound). On real one-slot llama.cpp workers (fresh seeds 226-230) a
        request held for a holder still prefilling the same document left at the break-even
        80 ms before the holder's answer ended, to a cold prefill: 3.2 s instead of ~1.9."""
        wait, start = _holder_gain(d), t.holder_priced
        if (wait.holder != t.holder or wait.priced is None or start is None
                or wait.priced.queue_ms >= start.queue_ms):
            return False
        left_s = q.config.holder_wait_ms / 1000.0 - (now - t.holder_since)
        wait_s = min(self._holder_wait_s(q.config, t.meta.priority, wait), left_s)
        if wait_s <= 0:
            return False
        t.holder_until = now + wait_s
        q.holding.add(t)
        return True

    def _book(self, pool: Pool, q: PoolQueue, d: Decision, req: InferenceRequest,
              fp: Fingerprint, info: FlowInfo, now: float, started: float | None,
              cost: float, *, direct: bool = False) -> Decision:
        """Route ``d`` and charge its tenant. A request routed at once (its tenant not
        backlogged) first lifts its tenant's counter to the band's virtual time, as queueing
        would have: a tenant served only at once otherwise keeps a counter from before it
        competed, and then claims the difference from tenants that were served all along."""
        d.flow = info
        self.router.book(d, pool, fp, req, now, started)
        q.serve(info.priority, info.tenant, cost, now, lift=direct)
        q.note_dispatch(now)
        for o in self.observers:
            o.on_dispatched(d, now)
        return d

    def _make_room(self, q: PoolQueue, t: Ticket, now: float) -> None:
        """A full band takes ``t`` by pushing out the newest request of the tenant that holds
        the most of it, if that is another tenant holding more; else ``t`` is refused."""
        p = t.meta.priority
        band = q.bands.get(p)
        if band is None or band.count < q.config.max_queued:
            return
        mine = len(band.tenants.get(t.meta.tenant, ()))
        longest = q.longest_tenant(p)
        if longest is None or longest[0] == t.meta.tenant or longest[1] <= mine + 1:
            raise self._report_new(q, t.request, t.meta,
                                   self._error(q, t.meta, fi.QUEUE_FULL, now), now)
        victim = band.tenants[longest[0]][-1]
        q.remove(victim)
        self._refuse(q, victim, fi.OVER_SHARE, now)


class _HolderWait(NamedTuple):
    holder: str | None  # the busy worker worth waiting for (None: none is)
    priced: Candidate | None  # it, as priced now
    gain_ms: float  # how much less it costs there (first token and later arrivals), queue included
    break_even_ms: float  # the longest wait that can still pay


def _price_ms(c: Candidate) -> float:
    """What placing the request on ``c`` costs, in ms: its predicted TTFT and the delay its
    prefill adds to later arrivals there (congestion, evictions), as the priced policy
    counts them at unit weights."""
    return c.predicted_ttft_ms + c.congestion_ms + c.eviction_ms


def _holder_gain(d: Decision) -> _HolderWait:
    """The closed worker the router would have picked (the best value, above the open
    winner's: typically the busy holder of the request's prefix); how many ms the placement
    there saves over the open winner, queue included (:func:`_price_ms`: the first token,
    and the prefill a miss makes later arrivals wait behind); and the break-even wait: the
    open winner's price less the holder's own for the request once free (without the
    queue). A wait longer than that loses even if the holder frees at once; waiting up to it
    costs at most twice the better choice made in hindsight (the ski-rental bound) whatever
    the holder's queue turns out to be, the least certain term (a busy one-slot engine's
    remaining decode). The gain alone, the bound before, sent requests away just before
    their holder freed; the first token alone, the price before, sent a request to a cold
    prefill on an idle worker the router's own value said cost more than the wait."""
    best = None
    for c in d.candidates:
        if c.filtered == CLOSED and (best is None or c.value > best.value):
            best = c
    if best is None or best.value <= d.winner.value:
        return _HolderWait(None, None, 0.0, 0.0)
    open_ms, holder_ms = _price_ms(d.winner), _price_ms(best)
    return _HolderWait(best.worker, best, open_ms - holder_ms,
                       open_ms - (holder_ms - best.queue_ms))


def _all(q: PoolQueue) -> list[Ticket]:
    return [t for b in q.bands.values() for t in b]
