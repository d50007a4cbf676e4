"""Flow control in the simulator: the core's :class:`~cachepilot.core.flow.control.FlowControl`
on the virtual clock, so the study runs the gateway's own scheduling (never a copy of it).

A :class:`SimFlow` says which scheduler a run models and how the simulator drives it: ours
and the baselines built from the core's parts (FCFS holding, the VTC paper's counters), or
another system's model (:mod:`cachepilot.sim.llmd_flow`), which brings its own gate, picker
and pacing. The simulator calls :meth:`FlowDriver.after_event` after every event (the
gateway pumps on first tokens, finishes, scrapes and deadlines; between events nothing in
the simulated pool changes), or only on its ticks when the model dispatches on a clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cachepilot.core.decision import Decision
from cachepilot.core.flow.classify import FlowMeta
from cachepilot.core.flow.config import FlowConfig
from cachepilot.core.flow.control import FlowControl
from cachepilot.core.flow.queue import Ticket
from cachepilot.core.router import Router


@dataclass(frozen=True)
class SimFlow:
    """A flow-control scheme for a simulated run.

    ``build`` makes the FlowControl over the run's router (default: the core's, with
    ``config``); ``tick_s`` > 0 dispatches only on a clock of that period and on arrivals,
    at most ``limit`` per pump (0: any number); ``charge_as_generated`` charges output
    tokens as the engines produce them (VTC) instead of an estimate at dispatch."""

    name: str = "ours"
    config: FlowConfig = field(default_factory=FlowConfig)
    build: Callable[[Router, FlowConfig], FlowControl] | None = None
    tick_s: float = 0.0
    limit: int = 0
    charge_as_generated: bool = False

    def make(self, router: Router) -> FlowControl:
        flow = (self.build or FlowControl)(router, self.config)
        flow.output_at_dispatch = not self.charge_as_generated
        router.add_plugin(flow.plugin)
        return flow


def meta_of(extra: dict[str, Any]) -> FlowMeta:
    """A simulated request's tenant, band and TTFT target (its ``extra``)."""
    return FlowMeta(tenant=str(extra.get("tenant", "default")),
                    priority=int(extra.get("priority", 0)),
                    slo_ms=extra.get("slo_ms"))


class FlowDriver:
    """Drives one FlowControl from the simulator's event loop."""

    def __init__(self, spec: SimFlow, router: Router,
                 schedule: Callable[[float], None]) -> None:
        self.spec = spec
        self.flow = spec.make(router)
        self._schedule = schedule  # asks the simulator for a FLOW event at a time
        self._next_at: float | None = None  # the FLOW event already scheduled

    def admit(self, req: Any, meta: FlowMeta, now: float,
              on_done: Callable[[Ticket], None]) -> Decision | Ticket:
        out = self.flow.admit(req, meta, now, on_done=on_done)
        if isinstance(out, Ticket) and self.spec.tick_s:
            self._timer(now + self.spec.tick_s)
        return out

    def after_event(self, now: float, *, timer: bool = False) -> None:
        """After an event: pump (event-driven schemes) and keep a timer for the next
        deadline or tick; ``timer``: this is that timer's event."""
        flow = self.flow
        if timer:
            self._next_at = None
        if not flow.held:
            return
        if not self.spec.tick_s or timer:
            flow.pump(now, self.spec.limit)
        if not flow.held:
            return
        if self.spec.tick_s:
            self._timer(now + self.spec.tick_s)
        else:
            self._timer(flow.next_deadline(now))

    def charge(self, d: Decision, tokens: int, now: float) -> None:
        """Output tokens as generated (VTC's per-token charge)."""
        if self.spec.charge_as_generated and d.flow is not None:
            self.flow.charge_output(d.pool, d.flow, tokens, now)

    def _timer(self, at: float) -> None:
        if at == float("inf"):
            return
        if self._next_at is None or at < self._next_at:
            self._next_at = at
            self._schedule(at)
