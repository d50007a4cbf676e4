"""Who hears of flow control: observers (metrics, the simulator's measures) of what it does,
and the lifecycle plugin through which the router's capacity events reach it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cachepilot.core.decision import Decision
from cachepilot.core.flow.classify import FlowMeta
from cachepilot.core.flow.queue import Ticket
from cachepilot.core.flow.refusal import FlowError
from cachepilot.core.lifecycle import Outcome, Plugin

if TYPE_CHECKING:
    from cachepilot.core.flow.control import FlowControl


class FlowObserver:
    """Hears what flow control does. Override what you need; methods run on flow control's
    thread and must not block."""

    def on_held(self, t: Ticket, now: float) -> None:
        """``t`` was queued."""

    def on_dispatched(self, d: Decision, now: float) -> None:
        """A request was routed by flow control (``d.flow`` says how; held or not)."""

    def on_refused(self, pool: str, meta: FlowMeta, err: FlowError, held_s: float,
                   now: float) -> None:
        """A request was answered with ``err`` after ``held_s`` seconds held (0: at once)."""

    def on_cancelled(self, t: Ticket, now: float) -> None:
        """``t``'s client left while it was held."""


class FlowPlugin(Plugin):
    """Capacity events (a first token, a finish) wake the pump; a finished request corrects
    its tenant's charge with the output tokens the worker reported."""

    def __init__(self, flow: FlowControl) -> None:
        self.flow = flow

    def on_first_token(self, decision: Decision, ttft_ms: float | None) -> None:
        self.flow.kick()

    def on_finish(self, decision: Decision, outcome: Outcome) -> None:
        f = decision.flow
        actual = outcome.completion_tokens
        if f is not None and actual is not None:
            at = outcome.completed_at if outcome.completed_at is not None else decision.time
            self.flow.settle(decision.pool, f, actual, at)
        self.flow.kick()
