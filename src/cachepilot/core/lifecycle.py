"""A request's lifecycle, and the typed plugins that act on it.

Modelled on the Gateway API Inference Extension's request control (pre-request, response
received, streaming, complete), kept smaller: every driver (the ext_proc gateway, the
simulator, replay) calls the :class:`~cachepilot.core.router.Router`'s lifecycle methods,
and the router calls the matching hook of the pool's policy, then of each plugin registered
with the router, in registration order:

==================  =================================  ======================================
router method       hook                               when
==================  =================================  ======================================
``route``           ``on_routed(decision, pool)``      chosen and booked (in flight, directory)
``route``/``reject`` ``on_rejected(error, request,      no worker was chosen: the request is
                    now)``                             answered with an error (any status)
``responded``       ``on_response(decision, response)`` the response's headers arrived
``first_token``     ``on_first_token(decision,         the worker answered; ``ttft_ms`` is a
                    ttft_ms)``                         measured time to first token, or None
                                                       when the answer says nothing about it
                                                       (a non-streamed body's headers)
``release``         ``on_finish(decision, outcome)``   finished, failed or abandoned: once
==================  =================================  ======================================

Hooks are plain methods with no-op defaults, so a plugin overrides only what it needs and the
router never looks hooks up by name. Plugins run on the router's thread and must not block:
what does I/O (the decision log, metrics) only hands the record on.

Side effects live here and nowhere beside the lifecycle: the gateway's recording, metrics and
stall tracking, the simulator's recording, the predictor and replica sync are all plugins,
assembled by one factory (:func:`cachepilot.records.plugins.lifecycle_plugins`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: pool → policies → lifecycle would be a cycle
    from cachepilot.core.decision import Decision
    from cachepilot.core.pool import Pool
    from cachepilot.core.request import InferenceRequest, RequestError

# What a measured ``ttft_ms`` means: a real first token (a streamed response's first chunk,
# or a simulated engine's first token), or a non-streamed response's first byte (TTFT plus
# the whole generation: not a TTFT, never learned from).
FIRST_TOKEN, FIRST_BYTE = "first_token", "first_byte"
TTFT_KINDS = (FIRST_TOKEN, FIRST_BYTE)


@dataclass(frozen=True, slots=True)
class Response:
    """A response's headers as the driver saw them."""

    status: int | None  # the HTTP status (None: not a number)
    at: float  # the driver's clock
    answered_by: str | None = None  # the worker the proxy says answered (None: not said)
    failed_over: bool = False  # another worker than the chosen one answered
    unreachable: bool = False  # the proxy says it could not connect to the chosen worker

    @property
    def model_output(self) -> bool:
        """A 2xx answer from the chosen worker: its first byte is the model's."""
        return self.status is not None and 200 <= self.status < 300 and not self.failed_over


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a routed request ended, as far as its driver saw: the one outcome type of every
    driver, what plugins learn from and what the decision log stores."""

    status: int | None = None  # the worker's HTTP status (None: it never answered)
    ttft_ms: float | None = None
    ttft_kind: str | None = None  # one of TTFT_KINDS when ttft_ms is set
    first_byte_ms: float | None = None  # request start → response headers
    cached_tokens: int | None = None  # prompt tokens the worker says came from its cache
    completion_tokens: int | None = None
    completed_at: float | None = None  # the driver's clock
    answered_by: str | None = None  # who answered, when the proxy said
    aborted: bool = False  # the client or the stream went away before the end
    # False: the driver never saw the response (Envoy configured without observation);
    # nothing about the request's end is known, so nothing is recorded or measured.
    observed: bool = True


class Plugin:
    """Receives the lifecycle of every request the router routes. Subclass and override."""

    def on_routed(self, decision: Decision, pool: Pool) -> None:
        """The decision is booked: its worker counts it in flight and holds its prefix."""

    def on_rejected(self, error: RequestError, request: InferenceRequest | None,
                    now: float) -> None:
        """No worker was chosen: the request is answered with ``error`` (``request`` None
        when it could not even be parsed)."""

    def on_response(self, decision: Decision, response: Response) -> None:
        """The response's headers arrived (gateway only: the simulator has no headers)."""

    def on_first_token(self, decision: Decision, ttft_ms: float | None) -> None:
        """The worker produced the first token; ``ttft_ms`` is measured, or None if unknown."""

    def on_finish(self, decision: Decision, outcome: Outcome) -> None:
        """The request no longer occupies its worker. Called exactly once per decision."""
