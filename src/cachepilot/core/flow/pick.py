"""Which held request goes next: fairness says which requests may, locality says which of
those.

:class:`FairPicker` (ours): the tenants whose counters are within ``bend_tokens`` of the
band's least-served backlogged tenant may be served; their requests, least-served tenant
first and oldest first within a tenant, up to ``lookahead`` of them, are the candidates.
``bend_tokens`` 0 and ``lookahead`` 1 is VTC's order (the least counter's oldest request).
:class:`FcfsPicker`: the band's oldest request, whoever sent it (holding without fairness).

:func:`locality_pick` then prefers, among the candidates, the request whose prefix an open
worker holds (the most prefill saved), when it saves ``locality_gain_ms`` over the first
candidate. Why this bounds the bend: a tenant leaves the candidates once its counter passes
the least by ``bend_tokens``, so locality can reorder tenants only within that credit, and
two backlogged tenants' counters stay within ``bend_tokens`` plus one request's cost (the
DLPM line of work's bound, kept as VTC counters instead of deficit rounds).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence

from cachepilot.core.flow.config import FlowConfig
from cachepilot.core.flow.queue import Band, PoolQueue, Ticket
from cachepilot.core.pool import Pool

Usable = Callable[[Ticket], bool]  # False: skip it now (it waits for its busy prefix holder)


class Picker:
    """Orders a band's held requests for dispatch. Subclass for another scheduler's model."""

    def candidates(self, q: PoolQueue, band: Band, now: float, usable: Usable) -> list[Ticket]:
        raise NotImplementedError

    def lag(self, q: PoolQueue, t: Ticket, now: float) -> float:
        """How far ahead of the band's least-served backlogged tenant ``t``'s tenant is, in
        weighted tokens (recorded with the decision)."""
        b = q.bands.get(t.meta.priority)
        if b is None or not b.tenants:
            return 0.0
        least = q.counters.least(((b.priority, x) for x in b.tenants), now)
        return max(0.0, q.counters.value(t.key, now) - least)


class FairPicker(Picker):
    """Weighted-token fair shares, bent by at most ``bend_tokens`` for locality.

    Tenants equally served (a tenant just backlogged is lifted to the least counter, so
    ties are common) go shortest queue first, then oldest request first: among equals, the
    one asking least waits least (``shortest_first``; off, the oldest request first, as the
    VTC paper's argmin over arrival order)."""

    def __init__(self, cfg: FlowConfig, *, shortest_first: bool = True) -> None:
        self.bend = cfg.bend_tokens
        self.lookahead = cfg.lookahead
        self.shortest_first = shortest_first

    def candidates(self, q: PoolQueue, band: Band, now: float, usable: Usable) -> list[Ticket]:
        value = q.counters.value
        served = {tenant: value((band.priority, tenant), now) for tenant in band.tenants}
        least = min(served.values())
        fifos = band.tenants
        if self.shortest_first:
            def key(t: str) -> tuple[float, int, int]:
                return (served[t], len(fifos[t]), fifos[t][0].seq)
        else:
            def key(t: str) -> tuple[float, int, int]:
                return (served[t], 0, fifos[t][0].seq)
        allowed = sorted((t for t, s in served.items() if s <= least + self.bend), key=key)
        out: list[Ticket] = []
        for depth in range(self.lookahead):
            more = False
            for tenant in allowed:
                fifo = band.tenants[tenant]
                if depth < len(fifo):
                    more = True
                    if usable(fifo[depth]):
                        out.append(fifo[depth])
                        if len(out) >= self.lookahead:
                            return out
            if not more:
                break
        return out


class FcfsPicker(Picker):
    """The band's oldest usable request: one FIFO across tenants."""

    def candidates(self, q: PoolQueue, band: Band, now: float, usable: Usable) -> list[Ticket]:
        merged = heapq.merge(*band.tenants.values(), key=lambda t: t.seq)
        return list(itertools.islice((t for t in merged if usable(t)), 1))


def make_picker(cfg: FlowConfig) -> Picker:
    return FcfsPicker() if cfg.fairness == "fcfs" else FairPicker(cfg)


def saved_ms(pool: Pool, t: Ticket, opened: Sequence[str]) -> float:
    """Prefill ms the best of the open workers would save ``t`` from the prefix it holds."""
    fp = t.fp
    if not fp.hashes or not opened:
        return 0.0
    matches = pool.directory.match(fp.hashes, opened)
    prior = pool.spec.cost.prefill_ms_per_token
    best = 0.0
    for addr, blocks in matches.items():
        if blocks:
            w = pool.workers[addr]
            per_token = w.ttft.prefill_ms_per_token if w.ttft is not None else prior
            best = max(best, min(blocks * fp.block_size, fp.tokens) * per_token)
    return best


def locality_pick(pool: Pool, cands: Sequence[Ticket], opened: Sequence[str],
                  min_gain_ms: float) -> tuple[list[Ticket], float]:
    """``cands`` in the order to try: the request whose prefix an open worker holds first,
    when it saves at least ``min_gain_ms`` of prefill over the fair pick (``cands[0]``),
    then the others in fair order; and the prefill ms it saves over the fair pick."""
    if len(cands) < 2:
        return list(cands), 0.0
    saved = [saved_ms(pool, t, opened) for t in cands]
    best = max(range(len(cands)), key=lambda i: (saved[i], -i))
    gain = saved[best] - saved[0]
    if best == 0 or gain < min_gain_ms:
        return list(cands), 0.0
    return [cands[best], *(t for i, t in enumerate(cands) if i != best)], gain
