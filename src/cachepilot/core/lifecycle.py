"""A routed request's lifecycle, and the typed plugins that learn from it.

Modelled on the Gateway API Inference Extension's request control (pre-request, response
received, streaming, complete), kept smaller: every driver (the ext_proc gateway, the
simulator, replay) calls the :class:`~cachepilot.core.router.Router`'s three lifecycle
methods, and the router calls the matching hook of the pool's policy, then of each plugin
registered with the router, in registration order:

======================  ===========================  ==========================================
router method           hook                         when
======================  ===========================  ==========================================
``route``               ``on_routed(decision, pool)``  chosen and booked (in flight, directory)
``first_token``         ``on_first_token(decision,     the worker answered; ``ttft_ms`` is a
                        ttft_ms)``                     measured time to first token, or None
                                                       when the answer says nothing about it
                                                       (a non-streamed body's headers)
``release``             ``on_finish(decision,          finished, failed or abandoned: once
                        outcome)``
======================  ===========================  ==========================================

Hooks are plain methods with no-op defaults, so a plugin overrides only what it needs and the
router never looks hooks up by name. Plugins run on the router's thread and must not block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: pool → policies → lifecycle would be a cycle
    from cachepilot.core.decision import Decision
    from cachepilot.core.pool import Pool

# What a measured ``ttft_ms`` means: a real first token (a streamed response's first chunk,
# or a simulated engine's first token), or a non-streamed response's first byte (TTFT plus
# the whole generation: not a TTFT, never learned from).
FIRST_TOKEN, FIRST_BYTE = "first_token", "first_byte"
TTFT_KINDS = (FIRST_TOKEN, FIRST_BYTE)


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a routed request ended, as far as its driver saw."""

    status: int | None = None  # the worker's HTTP status (None: it never answered)
    ttft_ms: float | None = None
    ttft_kind: str | None = None  # one of TTFT_KINDS when ttft_ms is set
    cached_tokens: int | None = None  # prompt tokens the worker says came from its cache
    aborted: bool = False  # the client or the stream went away before the end


class Plugin:
    """Receives the lifecycle of every request the router routes. Subclass and override."""

    def on_routed(self, decision: Decision, pool: Pool) -> None:
        """The decision is booked: its worker counts it in flight and holds its prefix."""

    def on_first_token(self, decision: Decision, ttft_ms: float | None) -> None:
        """The worker produced the first token; ``ttft_ms`` is measured, or None if unknown."""

    def on_finish(self, decision: Decision, outcome: Outcome) -> None:
        """The request no longer occupies its worker. Called exactly once per decision."""
