"""Which routed exchanges wait for what, by decision id: an observing stream to take them
over (Envoy opens it after the routing answer, on another gRPC stream), Envoy's access log
entry to end them (observed until the first token), and, once Envoy ended the request, how
long that entry has been due. Plain bookkeeping for the Envoy adapter
(``cachepilot.gateway.envoy_streams``), which ends what the sweeps hand back."""

from __future__ import annotations

from collections import OrderedDict

from cachepilot.core.decision import Decision
from cachepilot.gateway.director import Exchange


class Handover:
    """Routed exchanges an observing stream will take over, by decision id, and those whose
    routing stream ended before one did (oldest first); those Envoy's access log will end,
    and those whose entry is due."""

    def __init__(self) -> None:
        self.live: dict[str, Exchange] = {}
        self.unobserved: OrderedDict[str, tuple[Exchange, float]] = OrderedDict()
        # Exchanges Envoy's access log ends (observed until the first token), by decision id,
        # oldest first, with when they were routed.
        self.unlogged: OrderedDict[str, tuple[Exchange, float]] = OrderedDict()
        # Of those, the ones whose request Envoy has ended (their routing stream closed),
        # oldest first, with when: the entry is due.
        self.ended: OrderedDict[str, tuple[Exchange, float]] = OrderedDict()

    def expect(self, d: Decision, ex: Exchange, now: float, *, logged: bool = False,
               observed: bool = True) -> None:
        """``observed``: an observing stream will take it over; ``logged``: Envoy's access
        log ends it."""
        if observed:
            self.live[d.id] = ex
        if logged:
            self.unlogged[d.id] = (ex, now)

    def logged(self, decision_id: str) -> Exchange | None:
        """The exchange whose access log entry this is (forgotten here), if it awaits one."""
        ex = self.unlogged.get(decision_id, (None, 0.0))[0]
        if ex is not None:  # (and if it came before its observing stream, none will)
            self._drop(decision_id)
        return ex

    def park(self, d: Decision, ex: Exchange, now: float) -> None:
        """The routing stream ended first: wait for the observing stream."""
        self.unobserved[d.id] = (ex, now)

    def take(self, decision_id: str | None) -> Exchange | None:
        ex = None if decision_id is None else self.live.pop(decision_id, None)
        if ex is not None:
            self.unobserved.pop(decision_id, None)  # type: ignore[arg-type]
        return ex

    def forget(self, d: Decision) -> None:
        self._drop(d.id)

    def _drop(self, decision_id: str) -> None:
        """Forget the exchange in every table."""
        for table in (self.live, self.unobserved, self.unlogged, self.ended):
            table.pop(decision_id, None)

    def sweep(self, now: float, after_s: float) -> list[Exchange]:
        """Exchanges parked longer than ``after_s`` (forgotten here; the caller ends them)."""
        return self._sweep(self.unobserved, now, after_s)

    def sweep_unlogged(self, now: float, after_s: float) -> list[Exchange]:
        """Exchanges whose access log entry has not come within ``after_s`` of routing (the
        finished ones forgotten too; the caller ends the others)."""
        return self._sweep(self.unlogged, now, after_s)

    def sweep_ended(self, now: float, grace_s: float) -> list[Exchange]:
        """Exchanges whose request ended ``grace_s`` ago with no access log entry since
        (forgotten here; the caller ends them)."""
        return self._sweep(self.ended, now, grace_s)

    def _sweep(self, parked: OrderedDict[str, tuple[Exchange, float]], now: float,
               after_s: float) -> list[Exchange]:
        """Forget, in every table, the exchanges ``parked`` has held ``after_s``; the
        unfinished ones, for the caller to end."""
        out = []
        for decision_id, ex in _older(parked, now, after_s):
            self._drop(decision_id)
            if not ex.done:
                out.append(ex)
        return out


def _older(parked: OrderedDict[str, tuple[Exchange, float]], now: float, after_s: float
           ) -> list[tuple[str, Exchange]]:
    """Take the entries of ``parked`` (oldest first) that have waited ``after_s``."""
    out = []
    while parked:
        decision_id, (ex, since) = next(iter(parked.items()))
        if now - since < after_s:
            break
        parked.popitem(last=False)
        out.append((decision_id, ex))
    return out
