"""Near-ties among several gateway replicas: who takes which.

Replicas share their placements over a bus (:mod:`cachepilot.core.sync`), but a placement
reaches the others only after the bus delay (the gateway publishes every 5 ms). Requests that
arrive within that window at different replicas are routed on the same view of the pool, so
each replica picks the same best worker: on a trace whose requests arrive in groups (a
client's fan-out; production traces whose timestamps group requests), four synced replicas
put a group's long prompts on fewer workers than one replica would, and the others queue
behind them (docs/results/replicas: the ``grouped`` workload; median and p90 TTFT 1.2-1.3×
one replica's without this). One replica never has the problem: it sees each of its own
bookings before the next decision.

:class:`ReplicaSpread` lets the replicas split such moments without talking. Among the
workers a decision values within ``rel_tolerance`` of the best (closer than the predictor
can tell apart), every replica computes the same assignment, a round-robin matching of those
workers to the active replicas (each replica first takes a worker of its own class: the
workers' address order modulo the number of replicas), and takes its own share: its j-th
pick within the window is its j-th assigned worker; past its share, the workers the others
would use last (their deepest). The matching is computed on the view the
others have: this replica's own picks within the window still count as free. Nothing
changes when this replica is alone (no peer heard within ``silent_after_s``), or when one
worker is clearly best (a cache hit, the only idle worker).

What the split cannot know, how many requests of a group each other replica got, is
settled by taking turns (:meth:`ReplicaSpread.hold_s`): where a request's prefill is long
enough that a few milliseconds are nothing to it, the k-th replica holds it k bus delays,
routing it on the placements of the replicas before it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class ReplicaSpread:
    """One replica's side. :class:`~cachepilot.core.sync.ReplicaSync` owns one and tells it
    which replicas it hears; the router asks it to pick among near-ties."""

    replica: str
    # Own placements younger than this are not known to the others yet: the bus's publish
    # interval (5 ms in the gateway) plus its transit, with headroom.
    window_s: float = 0.01
    # Values this close to the best, relative, are ties when another replica may be routing
    # at the same moment: below the predictor's typical error (docs/results/peers: a median
    # |error| of 4-15 % of the TTFT), and far below what a collision costs (a whole prefill).
    rel_tolerance: float = 0.1
    # A replica not heard from for this long is not routing.
    silent_after_s: float = 5.0
    # How long a placement takes to reach the others: the gateway's bus flushes every 5 ms,
    # plus transit (the simulator sets its bus delay plus a margin).
    reach_s: float = 0.006
    # The longest a replica holds a request, as a share of that request's own prefill (a
    # collision costs the request that comes second a whole prefill; see hold_s).
    hold_share: float = 0.03
    _heard: dict[str, float] = field(default_factory=dict)
    _own: deque[tuple[float, str]] = field(default_factory=deque)

    def heard(self, replica: str, now: float) -> None:
        """Another replica's event arrived: it is routing."""
        if replica != self.replica:
            self._heard[replica] = max(now, self._heard.get(replica, now))

    def replicas(self, now: float) -> list[str]:
        """The replicas routing now, this one included, in their common order."""
        live = [r for r, t in self._heard.items() if now - t < self.silent_after_s]
        return sorted({self.replica, *live})

    def active(self, now: float) -> bool:
        return len(self.replicas(now)) > 1

    def turn(self, now: float) -> int:
        """This replica's place in the common order: 0 when it is first, or alone."""
        return self.replicas(now).index(self.replica)

    def tolerance(self, best: float, base: float) -> float:
        """The tie tolerance of a decision whose best value is ``best`` (a policy's values
        are minus milliseconds): the policy's own, or ``rel_tolerance`` of the best."""
        return max(base, self.rel_tolerance * abs(best))

    def _recent(self, now: float) -> list[str]:
        own = self._own
        while own and own[0][0] < now - self.window_s:
            own.popleft()
        return [w for _, w in own]

    def choose(self, workers: Sequence[str], tied: Sequence[int], now: float) -> int | None:
        """Which of the ``tied`` (indices into ``workers``, the eligible candidates) this
        replica takes; None when it is alone or the matching leaves it nothing tied."""
        names = self.replicas(now)
        n = len(names)
        if n < 2 or not tied:
            return None
        rank = names.index(self.replica)
        recent = self._recent(now)
        klass = {w: k % n for k, w in enumerate(sorted(workers))}
        local = {workers[i] for i in tied}
        free = sorted(local | (set(recent) & klass.keys()))
        shares = [_share(free, klass, n, q) for q in range(n)]
        mine, j = shares[rank], len(recent)
        pick = next((w for w in mine[j:] if w in local), None)
        if pick is None:
            pick = next((w for w in mine if w in local), None)
        if pick is None:  # more requests than its share: the others' least likely used
            taken = set(recent)
            pick = next((w for w in _spares(shares, rank) if w in local and w not in taken),
                        None)
        return None if pick is None else list(workers).index(pick)

    def hold_s(self, prefill_ms: float, now: float) -> float:
        """How long to hold a request whose prefill on its best worker is ``prefill_ms``
        before routing it (0: route now). Requests that arrive together at different
        replicas are routed before any hears of the others; the split above spreads the
        near-ties, but not a clear best (the one idle worker) nor a replica that got more
        of the group than its share. So the replicas take turns: the k-th in the common
        order waits k times ``reach_s``, by which time the placements of those before it
        have arrived, and routes on them. Only where that wait is at most ``hold_share``
        of the request's own prefill: long, uncached prompts, where landing second on a
        worker costs a whole prefill; never on a hit or a short prompt."""
        wait = self.turn(now) * self.reach_s
        return wait if 0 < wait * 1000.0 <= self.hold_share * prefill_ms else 0.0

    def picked(self, worker: str, now: float) -> None:
        """This replica placed a request on ``worker``."""
        if self._heard:
            self._recent(now)
            self._own.append((now, worker))


def _spares(shares: list[list[str]], rank: int) -> list[str]:
    """The other replicas' workers beyond their first, least likely in use first: a replica
    takes its share front first, so its last workers are used only when it gets that many
    requests at once; among equal depths, the replicas after ``rank`` first (two replicas
    short of workers then look in different places). Never another's first worker: that one
    is in use whenever its replica gets a request at all (taking those too did worse with 8
    replicas on the development seeds)."""
    n = len(shares)
    order = [(rank + k) % n for k in range(1, n)]
    depth = max((len(s) for s in shares), default=0)
    return [shares[q][d] for d in range(depth - 1, 0, -1) for q in order if d < len(shares[q])]


def _share(free: list[str], klass: dict[str, int], n: int, rank: int) -> list[str]:
    """Replica ``rank``'s workers, in order, in the round-robin matching of ``free`` workers
    to ``n`` replicas: each round every replica takes the first free worker of its class,
    then those left without one take the first free workers in order."""
    left = list(free)
    mine: list[str] = []
    while left:
        got: dict[int, str] = {}
        for q in range(n):
            w = next((w for w in left if klass[w] == q), None)
            if w is not None:
                got[q] = w
                left.remove(w)
        for q in range(n):
            if q not in got and left:
                got[q] = left.pop(0)
        if rank in got:
            mine.append(got[rank])
    return mine
