"""One HTTP exchange through the gateway, free of any protocol: route, first byte, stream,
finish.

Both ext_proc protocols the gateway speaks (our Envoy config's streams,
:mod:`cachepilot.gateway.envoy_streams`, and the endpoint picker protocol,
:mod:`cachepilot.gateway.epp`) are thin adapters: they turn Envoy's messages into the calls
below and the results back into answers. The :class:`Director` drives the router's lifecycle
(:mod:`cachepilot.core.lifecycle`); what reacts to it (recording, metrics, stall tracking,
learning) are plugins, never code here. An :class:`Exchange` is in one :class:`Phase` at a
time, and only the director moves it.
"""

from __future__ import annotations

import asyncio
import enum
import re
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from cachepilot.core.decision import Decision
from cachepilot.core.flow.classify import classify
from cachepilot.core.flow.control import FlowControl
from cachepilot.core.flow.queue import QUEUED, Ticket
from cachepilot.core.lifecycle import FIRST_BYTE, FIRST_TOKEN, Outcome, Response
from cachepilot.core.request import (
    InferenceRequest,
    RequestError,
    UnparseableBody,
    inference_path,
    parse_openai_body,
    unparsed_request,
)
from cachepilot.core.router import Router

_CACHED_RE = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_CACHE_N_RE = re.compile(rb'"cache_n"\s*:\s*(\d+)')  # llama.cpp /completion timings
_COMPLETION_RE = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_PREDICTED_N_RE = re.compile(rb'"predicted_n"\s*:\s*(\d+)')  # llama.cpp timings
R = TypeVar("R")
_TAIL = 512  # bytes of the previous chunk kept so a split "cached_tokens" is still found


@dataclass
class GatewayOptions:
    max_body_bytes: int = 8 * 1024 * 1024
    capture_prompts: bool = False  # hand raw prompts to the decision log (off: hashes only)
    # Must match Envoy's config: off, the stream ends with the request phase, so a request
    # stops counting as in flight once routed and no outcome is recorded.
    observe_responses: bool = True
    # Must match Envoy's config too: responses come on a second, observing stream, which
    # releases the request (off: on the routing stream, which releases it when it ends).
    # Envoy's generated config says which on every routing stream (x-cachepilot-observe),
    # and that wins over this default.
    observe_async: bool = True
    # A routed request whose observing stream has not started after this long never gets one
    # (Envoy configured without it, or the stream failed): released as aborted. With Envoy's
    # observe_request_headers off the stream starts at the first byte: set this above Envoy's
    # first-byte timeout then.
    unobserved_after_s: float = 10.0
    # Observing until the first token (Envoy's default config): a routed request whose end
    # Envoy's access log has not reported after this long never gets it (the log stream was
    # down, or Envoy dropped the entry): released as aborted. Longer than any answer.
    unlogged_after_s: float = 3600.0
    # Observed until the first token, a request's routing stream stays open until Envoy
    # ends the request, and its access log entry (on another connection, so it may come a
    # little later) is awaited this long after that end before the request is released as
    # aborted (the client left before Envoy applied the routing answer, so no entry names
    # the decision; or the entry was lost).
    logged_grace_s: float = 5.0
    # Which ext_proc protocol a stream speaks: "cachepilot" (Envoy configured by the
    # gateway's bootstrap), "epp" (the endpoint picker protocol, any gateway), or "auto": a
    # stream whose gRPC metadata has an x-cachepilot-* key is ours, others EPP.
    protocol: str = "auto"

    def __post_init__(self) -> None:
        if self.protocol not in ("auto", "cachepilot", "epp"):
            raise ValueError(f"protocol is auto, cachepilot or epp, not {self.protocol!r}")


class Phase(enum.Enum):
    NEW = "new"  # nothing known but, maybe, its method and path
    PASSTHROUGH = "passthrough"  # not inference: sent to any ready worker, nothing to watch
    FAILED = "failed"  # answered by the gateway with an error; no worker involved
    HELD = "held"  # no worker yet: flow control holds it, or this replica waits its turn
    ROUTED = "routed"  # a worker was chosen and booked; its response is awaited
    RESPONDING = "responding"  # the response's headers arrived
    DONE = "done"  # released: the lifecycle's end was reported


@dataclass
class Exchange:
    """What one HTTP exchange has told the director so far."""

    method: str = ""
    path: str = ""
    content_length: int | None = None
    phase: Phase = Phase.NEW
    started: float = 0.0  # the director's clock
    stream: bool = False  # the client asked for a streamed (SSE) answer
    decision: Decision | None = None
    status: int | None = None
    answered_by: str | None = None  # the worker that answered, as the proxy reports it
    model_output: bool = False  # a 2xx answer from the chosen worker
    # From the decision (a request flow control held: from its dispatch, what the router
    # predicted; the hold itself is in decision.flow.held_ms).
    first_byte_s: float | None = None
    first_token_s: float | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None  # the worker's usage, when it reports it
    tail: bytes = b""  # the end of the last response chunk (a split "cached_tokens")

    @property
    def inference(self) -> bool:
        """A POST to an inference path: routed by its body."""
        return self.method == "POST" and bool(inference_path(self.path))

    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE


def too_large(limit: int) -> RequestError:
    """The one 413, for a declared length, a whole body or a body still arriving; worded as
    Envoy's own 413 for a declared length over the limit (the bootstrap's local reply)."""
    return RequestError(413, f"request body exceeds the limit of {limit} bytes",
                        code="body_too_large")


@dataclass(frozen=True, slots=True)
class Turn:
    """A request this replica routes after ``wait_s``, once the placements of the replicas
    before it in their common order have arrived (:meth:`ReplicaSpread.hold_s`)."""

    req: InferenceRequest
    wait_s: float
    only: Collection[str] | None
    started: float
    headers: Mapping[str, str] | None


class Pending(Generic[R]):
    """What an adapter answers once a held request leaves flow control's queue: ``then``
    builds the answers from its decision, ``fail`` from its refusal. The servicer awaits
    :meth:`answers`; a client that leaves meanwhile cancels the wait, which takes the
    request out of the queue at once."""

    def __init__(self, director: Director, ex: Exchange, ticket: Ticket | Turn,
                 then: Callable[[Decision], list[R]],
                 fail: Callable[[RequestError], list[R]]) -> None:
        self.director, self.ex, self.ticket = director, ex, ticket
        self.then, self.fail = then, fail

    async def answers(self) -> list[R]:
        try:
            decision = await self.director.wait(self.ex, self.ticket)
        except RequestError as err:
            return self.fail(err)
        return self.then(decision)


class Director:
    """Drives exchanges through the router's lifecycle, on the caller's clock. With ``flow``
    (flow control), a request no worker should take now is held: :meth:`route` returns its
    :class:`~cachepilot.core.flow.queue.Ticket` and :meth:`wait` waits for its decision."""

    def __init__(self, router: Router, *, options: GatewayOptions | None = None,
                 clock: Callable[[], float] = time.time,
                 on_passthrough: Callable[[], None] = lambda: None,
                 flow: FlowControl | None = None) -> None:
        self.router = router
        self.options = options or GatewayOptions()
        self.clock = clock
        self.on_passthrough = on_passthrough
        self.flow = flow
        self._passthrough_seq = 0

    # -- request ------------------------------------------------------------------------------
    def begin(self, ex: Exchange, method: str, path: str, content_length: str | None = None,
              *, end_of_stream: bool = False) -> RequestError | None:
        """The request line: an error if it cannot be routed (already reported)."""
        ex.started = self.clock()
        ex.method, ex.path = method, path
        if content_length is not None:
            ex.content_length = int(content_length) if content_length.isdigit() else None
        if not ex.inference:
            return None
        if ex.content_length is not None and ex.content_length > self.options.max_body_bytes:
            return self.fail(ex, too_large(self.options.max_body_bytes))
        if end_of_stream:
            return self.fail(ex, RequestError(400, "request body is empty"))
        return None

    def check_size(self, ex: Exchange, size: int) -> RequestError | None:
        """A body (or as much as has arrived) over the limit: the 413, reported."""
        if size > self.options.max_body_bytes:
            return self.fail(ex, too_large(self.options.max_body_bytes))
        return None

    def route(self, ex: Exchange, raw: bytes, *, only: Collection[str] | None = None,
              unparseable_by_load: bool = False,
              headers: Mapping[str, str] | None = None) -> Decision | Ticket | Turn:
        """Parse the whole body and route it, or hold it (:meth:`wait` for its decision): a
        Ticket when flow control is on and no worker should take it now, a Turn when this
        replica routes a long prompt after the others' placements arrive. ``only``: the
        workers that may be picked (the proxy's subset hint). ``unparseable_by_load``: a
        body that is not a JSON object is routed by load alone (the engine answers it)
        instead of refused. ``headers``: the request headers flow control reads (tenant,
        priority, TTFT target; lower-case names). Raises RequestError (RoutingError
        included) with the status the client gets, already reported to the lifecycle."""
        started = time.perf_counter()
        try:
            req = parse_openai_body(ex.path, raw)
        except UnparseableBody as err:
            if not unparseable_by_load:
                raise self.fail(ex, err) from None
            req = self._unparsed(raw)
        except RequestError as err:
            raise self.fail(ex, err) from None
        ex.stream = req.stream
        wait = self.router.replica_hold_s(req, self.clock())
        if wait > 0:  # this replica's turn on a long prompt comes later (core.spread)
            ex.phase = Phase.HELD
            return Turn(req, wait, only, started, headers)
        return self._admit(ex, req, only, started, headers)

    def _admit(self, ex: Exchange, req: InferenceRequest, only: Collection[str] | None,
               started: float, headers: Mapping[str, str] | None) -> Decision | Ticket:
        flow = self.flow
        try:
            if flow is None:
                out: Decision | Ticket = self.router.route(req, self.clock(), only=only,
                                                           started=started)
            else:
                try:
                    meta = classify(headers or {}, flow.config, flow.objectives)
                except RequestError as err:
                    raise self.fail(ex, err, req) from None
                out = flow.admit(req, meta, self.clock(), only=only, started=started)
        except RequestError as err:  # routing errors: the router reported them
            ex.phase = Phase.FAILED
            raise err from None
        if isinstance(out, Decision):
            ex.decision, ex.phase = out, Phase.ROUTED
        else:
            ex.phase = Phase.HELD
        return out

    async def wait(self, ex: Exchange, ticket: Ticket | Turn) -> Decision:
        """The decision of a held request, once its replica's turn comes and flow control
        dispatches it; its refusal raised (already reported). Cancelled (its client left):
        out of the queue at once."""
        if isinstance(ticket, Turn):
            slept = time.perf_counter()
            try:
                await asyncio.sleep(ticket.wait_s)
            except asyncio.CancelledError:
                ex.phase = Phase.FAILED
                raise
            # The decision's latency is the gateway's work on it, not the turn it waited,
            # which the decision records apart.
            waited = time.perf_counter() - slept
            req = replace(ticket.req, turn_ms=waited * 1000.0)
            routed = self._admit(ex, req, ticket.only, ticket.started + waited, ticket.headers)
            if isinstance(routed, Decision):
                return routed
            ticket = routed
        assert self.flow is not None
        if ticket.state == QUEUED:
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            ticket.on_done = lambda _: done.done() or done.set_result(None)
        try:
            if ticket.state == QUEUED:
                await done
        except asyncio.CancelledError:
            if ticket.decision is not None:
                # Dispatched (booked on its worker) just before its client left, the wait not
                # yet resumed: the exchange holds the decision, so the stream's end releases it.
                ex.decision, ex.phase = ticket.decision, Phase.ROUTED
            else:
                self.flow.cancel(ticket, self.clock())
                ex.phase = Phase.FAILED
            raise
        if ticket.decision is None:
            ex.phase = Phase.FAILED
            assert ticket.error is not None
            raise ticket.error
        ex.decision, ex.phase = ticket.decision, Phase.ROUTED
        return ticket.decision

    def _unparsed(self, raw: bytes) -> InferenceRequest:
        """An unparseable body's request: the model it seems to name if a pool serves it,
        else one a pool serves (the router then prices the workers on load alone)."""
        req = unparsed_request(raw)
        pools = self.router.pools.values()
        if any(req.model in p.spec.models or not p.spec.models for p in pools):
            return req
        model = next((m for p in pools for m in p.spec.models), "")
        return InferenceRequest(model=model, kind="unparsed")

    def fail(self, ex: Exchange | None, err: RequestError,
             req: InferenceRequest | None = None) -> RequestError:
        """The gateway answers ``err`` itself: reported to the lifecycle once."""
        if ex is not None:
            ex.phase = Phase.FAILED
        self.router.reject(err, req, self.clock())
        return err

    def any_worker(self, ex: Exchange | None = None, only: Collection[str] | None = None
                   ) -> str | None:
        """A request that is not inference (GET /v1/models, /health) goes to any ready
        worker, in turn (of ``only``, when the proxy hints a subset)."""
        ready = sorted(addr for pool in self.router.pools.values()
                       for addr, w in pool.workers.items()
                       if w.ready and (only is None or addr in only))
        if not ready:
            return None  # nothing to send it to
        if ex is not None:
            ex.phase = Phase.PASSTHROUGH
        self._passthrough_seq += 1
        self.on_passthrough()
        return ready[self._passthrough_seq % len(ready)]

    # -- response -----------------------------------------------------------------------------
    def response_started(self, ex: Exchange, status: str | None, answered_by: str | None,
                         error: str | None, end_of_stream: bool, at: float | None = None
                         ) -> None:
        """The response's headers: its status, the worker the proxy says answered it, the
        reason the proxy gives for an error reply of its own; ``at``: when they came, if
        not now."""
        now = self.clock() if at is None else at
        if status is not None:
            ex.status = int(status) if status.isdigit() else None
        ex.answered_by = answered_by or ex.answered_by
        d = ex.decision
        if d is None or ex.done:
            return
        ex.phase = Phase.RESPONDING
        response = Response(status=ex.status, at=now, answered_by=answered_by,
                            failed_over=bool(answered_by) and answered_by != d.chosen,
                            unreachable=error == "worker_unreachable")
        self.router.responded(d, response)
        ex.model_output = response.model_output
        if ex.model_output:
            ex.first_byte_s = now - _routed_at(ex, d)
            if not ex.stream:  # a non-streamed answer arrives whole: headers = first token
                self.router.first_token(d)
        if end_of_stream:
            self.finish(ex)

    def response_chunk(self, ex: Exchange, data: bytes, end_of_stream: bool) -> None:
        """A piece of the response body: the first token's time, the worker's cached-token
        count; the last piece ends the request."""
        d = ex.decision
        if d is None or ex.done:
            return
        if ex.first_token_s is None and data and ex.model_output:
            ex.first_token_s = self.clock() - _routed_at(ex, d)
            # Streamed: a real first token, the policy and plugins learn from it.
            self.router.first_token(d, ex.first_token_s * 1000.0 if ex.stream else None)
        window = ex.tail + data
        found = _CACHED_RE.findall(window) or _CACHE_N_RE.findall(window)
        if found:
            ex.cached_tokens = int(found[-1])
        if self.flow is not None:  # the real output, which corrects its tenant's charge
            found = _COMPLETION_RE.findall(window) or _PREDICTED_N_RE.findall(window)
            if found:
                ex.completion_tokens = int(found[-1])
        ex.tail = window[-_TAIL:]
        if end_of_stream:
            self.finish(ex)

    def logged_end(self, ex: Exchange, *, status: int | None, answered_by: str | None,
                   cached_tokens: int | None, completion_tokens: int | None,
                   aborted: bool, first_byte_at: float | None = None,
                   ended_at: float | None = None, error: str | None = None) -> None:
        """The response's end as Envoy's access log reports it (its observing stream stopped
        at the first token, or there was none): its status, who answered, the usage Envoy
        read from its end; ``first_byte_at`` and ``ended_at``: when the worker's first byte
        came and when the response ended (by Envoy's timings: the entry may come a batch
        later; None: now), ``error``: Envoy's reason for an error reply of its own."""
        if ex.done or ex.decision is None:
            return
        if ex.phase is not Phase.RESPONDING and status:  # no observer saw the headers
            self.response_started(ex, str(status), answered_by, error, False,
                                  at=first_byte_at)
        if status:  # 0: Envoy got no response to log
            ex.status = status
        ex.answered_by = answered_by or ex.answered_by
        if cached_tokens is not None:
            ex.cached_tokens = cached_tokens
        if completion_tokens is not None:
            ex.completion_tokens = completion_tokens
        self.finish(ex, aborted=aborted, at=ended_at)

    def ended(self, ex: Exchange) -> None:
        """The proxy ended the request, and its access log entry, a batch later, will say
        how: its worker is free now (:meth:`Router.vacate`)."""
        d = ex.decision
        if d is not None and not ex.done:
            self.router.vacate(d, self.clock())

    def finish(self, ex: Exchange, aborted: bool = False, at: float | None = None) -> None:
        """Release the worker once and report the outcome (the lifecycle's end); ``at``:
        when the response ended, if not now."""
        d = ex.decision
        if ex.done or d is None:
            return
        ex.phase = Phase.DONE
        ttft_s = ex.first_token_s if ex.stream else ex.first_byte_s
        self.router.release(d, Outcome(
            status=ex.status, aborted=aborted,
            ttft_ms=None if ttft_s is None else ttft_s * 1000.0,
            ttft_kind=FIRST_TOKEN if ex.stream else FIRST_BYTE,
            first_byte_ms=None if ex.first_byte_s is None else ex.first_byte_s * 1000.0,
            cached_tokens=ex.cached_tokens, completion_tokens=ex.completion_tokens,
            completed_at=self.clock() if at is None else at,
            answered_by=ex.answered_by, observed=self.options.observe_responses))


def _routed_at(ex: Exchange, d: Decision) -> float:
    """When the request was routed: its start, plus the time flow control held it and the
    time its replica held it for its turn (the predictor learns the worker's TTFT from
    routing, as the simulator's does)."""
    held_ms = (d.flow.held_ms if d.flow is not None else 0.0) + d.turn_ms
    return ex.started + held_ms / 1000.0
