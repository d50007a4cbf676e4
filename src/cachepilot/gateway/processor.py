"""The ext_proc state machine both protocols share: parse and route a request, watch its
response (status, who answered, first byte and token, cached tokens) and release it.

It is free of gRPC so tests and the simulator-equivalence check can drive it with plain
ProcessingRequest messages. :meth:`Processor.handle` and :meth:`Processor.observe` speak
CachePilot's own Envoy config (:mod:`cachepilot.gateway.service` explains its two streams);
the endpoint picker adapter (:mod:`cachepilot.gateway.epp`) drives the same steps
(:meth:`Processor.route`, :meth:`Processor.any_worker`, :meth:`Processor.response_started`,
:meth:`Processor.response_chunk`) from a FULL_DUPLEX_STREAMED stream.
"""

from __future__ import annotations

import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, Protocol

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from cachepilot.core.decision import Decision, RoutingError
from cachepilot.core.lifecycle import FIRST_BYTE, FIRST_TOKEN, Outcome
from cachepilot.core.request import RequestError, inference_path, parse_openai_body
from cachepilot.core.router import Router
from cachepilot.gateway.gateway_metrics import GatewayMetrics
from cachepilot.gateway.protocol import (
    CHOSEN_KEY,
    DECISION_HEADER,
    DECISION_KEY,
    DESTINATION_HEADER,
    ERROR_HEADER,
    WORKER_HEADER,
    fallback_list,
    header_mutation,
    header_value,
    immediate,
    lb_metadata,
    lb_value,
)
from cachepilot.records import NullRecorder

log = logging.getLogger("cachepilot.extproc")

_CACHED_RE = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_CACHE_N_RE = re.compile(rb'"cache_n"\s*:\s*(\d+)')  # llama.cpp /completion timings
_TAIL = 512  # bytes of the previous chunk kept so a split "cached_tokens" is still found
_CONTINUE_HEADERS = ep.ProcessingResponse(request_headers=ep.HeadersResponse())


def _routed(d: Decision) -> ep.CommonResponse:
    """The routing answer's common part: the destination and decision id headers, and a
    cleared route cache so the route sees them (and any envoy.lb metadata beside them)."""
    return ep.CommonResponse(header_mutation=header_mutation(
        {DESTINATION_HEADER: d.chosen, DECISION_HEADER: d.id}), clear_route_cache=True)


class DecisionSink(Protocol):
    """Where decisions and their outcomes go: cachepilot.records's Recorder or NullRecorder."""

    def decision(self, decision: Decision, pool: Any = None, *,
                 prompt: str | None = None) -> Any: ...

    def outcome(self, decision_id: str, **fields: Any) -> Any: ...


@dataclass
class GatewayOptions:
    max_body_bytes: int = 8 * 1024 * 1024
    capture_prompts: bool = False  # hand raw prompts to the sink (off: hashes only)
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
    # Which ext_proc protocol a stream speaks: "cachepilot" (Envoy configured by
    # envoy_config.build_bootstrap), "epp" (the endpoint picker protocol, any gateway), or
    # "auto": a stream whose gRPC metadata has an x-cachepilot-* key is ours, others EPP.
    protocol: str = "auto"

    def __post_init__(self) -> None:
        if self.protocol not in ("auto", "cachepilot", "epp"):
            raise ValueError(f"protocol is auto, cachepilot or epp, not {self.protocol!r}")


class _NoPool:
    def set_down(self, *_: object) -> None:
        pass


@dataclass
class Exchange:
    """What one HTTP exchange has told us so far."""

    method: str = ""
    path: str = ""
    content_length: int | None = None
    stream: bool = False
    decision: Decision | None = None
    started: float = 0.0
    status: int | None = None
    first_byte_s: float | None = None
    first_token_s: float | None = None
    model_output: bool = False  # a 2xx answer from the chosen worker
    cached_tokens: int | None = None
    tail: bytes = b""
    body: bytearray = field(default_factory=bytearray)
    chunks: int = 0  # request body messages not yet answered
    inference: bool = False
    done: bool = False
    observed: bool = False  # an observing stream has taken this exchange over
    sees_response: bool = False  # the routing stream carries the response itself
    handed_over: float = 0.0  # when the routing stream ended, leaving it to the observer
    buffered: bool = False  # the body comes whole, after the headers' (immediate) answer
    body_only: bool = False  # no headers message: the whole body is the stream's first
    observe: str = ""  # as Envoy's config says on the stream ("async", "sync", "off"), or ""
    answered_by: str | None = None  # the worker that answered, as the proxy reports it


class Processor:
    """The state machine, free of gRPC so tests and the simulator-equivalence check can
    drive it with plain ProcessingRequest messages."""

    def __init__(self, router: Router, *, metrics: GatewayMetrics | None = None,
                 sink: DecisionSink | None = None, options: GatewayOptions | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.router = router
        self.metrics = metrics or GatewayMetrics()
        self.sink: DecisionSink = sink or NullRecorder()
        self.options = options or GatewayOptions()
        self.clock = clock
        self._passthrough_seq = 0
        # Routed requests without a first byte yet, by worker (decision id → routed at), and
        # each worker's last first byte: a worker that answers none of them has stalled.
        self.awaiting: dict[str, dict[str, float]] = {}
        self.last_first_byte: dict[str, float] = {}
        # Routed exchanges an observing stream will take over (by decision id), and those of
        # them not yet taken, oldest first (released as aborted after unobserved_after_s).
        self.live: dict[str, Exchange] = {}
        self.unobserved: OrderedDict[str, Exchange] = OrderedDict()
        self._latency: dict[str, Any] = {}  # per pool: the decision-latency histogram child

    def handle(self, ex: Exchange, msg: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        """Answer one message from Envoy: zero or more responses, in the order Envoy expects."""
        kind = msg.WhichOneof("request")
        if kind == "request_headers":
            return self._request_headers(ex, msg.request_headers)
        if kind == "request_body":
            if ex.body_only:
                return self._whole_body(ex, msg.request_body)
            return self._request_body(ex, msg.request_body)
        if kind == "response_headers":
            if ex.decision is not None:  # the routing stream carries the response itself
                ex.sees_response = True
            return [self._response_headers(ex, msg.response_headers)]
        if kind == "response_body":
            return [self._response_body(ex, msg.response_body)]
        if kind == "request_trailers":
            return [ep.ProcessingResponse(request_trailers=ep.TrailersResponse())]
        if kind == "response_trailers":
            return [ep.ProcessingResponse(response_trailers=ep.TrailersResponse())]
        raise RequestError(400, f"unexpected ext_proc message {kind!r}")

    # -- request ------------------------------------------------------------------------------
    def begin(self, ex: Exchange, msg: ep.HttpHeaders) -> RequestError | None:
        """Note the request's method, path and length; an error if it cannot be routed."""
        ex.started = self.clock()
        for h in msg.headers.headers:
            if h.key == ":path":
                ex.path = header_value(h)
            elif h.key == ":method":
                ex.method = header_value(h)
            elif h.key == "content-length":
                value = header_value(h)
                ex.content_length = int(value) if value.isdigit() else None
        ex.inference = bool(inference_path(ex.path)) and ex.method == "POST"
        if not ex.inference:
            return None
        if ex.content_length is not None and ex.content_length > self.options.max_body_bytes:
            return self._too_large(ex.content_length)
        if msg.end_of_stream:
            return RequestError(400, "request body is empty")
        return None

    def _request_headers(self, ex: Exchange, msg: ep.HttpHeaders) -> list[ep.ProcessingResponse]:
        err = self.begin(ex, msg)
        if err is not None:
            return [self._error(err)]
        if not ex.inference:  # GET /v1/models, /health, …: any ready worker answers
            target = self.any_worker()
            return [ep.ProcessingResponse(request_headers=ep.HeadersResponse(
                response=ep.CommonResponse() if target is None else ep.CommonResponse(
                    header_mutation=header_mutation({DESTINATION_HEADER: target}),
                    clear_route_cache=True)))]
        if ex.buffered:  # Envoy sends the body once the headers are answered
            return [_CONTINUE_HEADERS]
        return []  # answered with the destination once the body is complete

    def _whole_body(self, ex: Exchange, msg: ep.HttpBody) -> list[ep.ProcessingResponse]:
        """Body-only routing: the stream's one message is the whole body of a POST to
        ``ex.path`` (Envoy's route matched both and refused over-long declared lengths). The
        answer routes through envoy.lb metadata; Envoy's buffer filter holds the headers
        until it comes, and clearing the route cache lets the route see the metadata."""
        ex.started = self.clock()
        ex.method, ex.inference = "POST", bool(inference_path(ex.path))
        if not ex.inference:
            return [self._error(RequestError(
                500, f"Envoy's route names no inference path for this body ({ex.path!r}); "
                     "is its config the gateway's?", code="proxy_config"))]
        if len(msg.body) > self.options.max_body_bytes:
            return [self._error(self._too_large(len(msg.body)))]
        if not msg.body:
            return [self._error(RequestError(400, "request body is empty"))]
        try:
            decision = self.route(ex, msg.body)
        except RequestError as err:
            return [self._error(err)]
        # Envoy applies no header mutation here (it sent no headers), but its default route
        # cache action clears the cache only for an answer that has one: this one makes the
        # route see the metadata (fail-open's picked route).
        return [ep.ProcessingResponse(
            request_body=ep.BodyResponse(response=_routed(decision)),
            dynamic_metadata=lb_metadata(fallback_list(decision), **{
                DECISION_KEY: decision.id, CHOSEN_KEY: decision.chosen}))]

    def _too_large(self, size: int) -> RequestError:
        return RequestError(
            413, f"request body is {size} bytes; the limit is {self.options.max_body_bytes}",
            code="body_too_large")

    def over_limit(self, size: int) -> RequestError | None:
        limit = self.options.max_body_bytes
        if size > limit:
            return RequestError(413, f"request body exceeds the limit of {limit} bytes",
                                code="body_too_large")
        return None

    def _request_body(self, ex: Exchange, msg: ep.HttpBody) -> list[ep.ProcessingResponse]:
        if not ex.inference:
            return [ep.ProcessingResponse(request_body=ep.BodyResponse())]
        ex.chunks += 1
        if msg.end_of_stream and not ex.body:  # the whole body in one message: no copy
            raw = msg.body
        else:
            ex.body += msg.body
            raw = bytes(ex.body) if msg.end_of_stream else b""
        err = self.over_limit(len(raw or ex.body))
        if err is not None:
            return [self._error(err)]
        if not msg.end_of_stream:
            return []
        ex.body = bytearray()
        try:
            decision = self.route(ex, raw)
        except RequestError as err:
            return [self._error(err)]
        common = _routed(decision)
        metadata = lb_metadata(fallback_list(decision))
        if ex.buffered:  # the headers wait for the body's answer, which carries the routing
            ex.chunks = 0
            return [ep.ProcessingResponse(request_body=ep.BodyResponse(response=common),
                                          dynamic_metadata=metadata)]
        out = [ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common),
                                     dynamic_metadata=metadata)]
        out += [ep.ProcessingResponse(request_body=ep.BodyResponse())] * ex.chunks
        ex.chunks = 0
        return out

    def route(self, ex: Exchange, raw: bytes, *, only: Collection[str] | None = None
              ) -> Decision:
        """Parse the whole body and route it (the decision is counted, recorded and
        awaited). ``only``: the workers that may be picked (the proxy's subset hint); none of
        them eligible is a 503. Raises RequestError (RoutingError included) with the status
        the client gets."""
        t0 = time.perf_counter()
        req = parse_openai_body(ex.path, raw)
        try:
            if only is None:
                decision = self.router.route(req, self.clock())
            else:
                decision = self._route_within(req, only)
        except RoutingError as err:
            raise self._why_no_worker(err) from None
        elapsed = time.perf_counter() - t0
        ex.decision, ex.stream = decision, req.stream
        m = self.metrics
        hist = self._latency.get(decision.pool)
        if hist is None:
            hist = self._latency[decision.pool] = m.decision_latency.labels(decision.pool)
        hist.observe(elapsed)
        m.decisions.labels(decision.pool, decision.policy, "routed").inc()
        if decision.predicted_hit:
            m.predicted_hits.labels(decision.pool).inc()
        pool = self.router.pools.get(decision.pool)
        self.sink.decision(decision, pool,
                           prompt=req.prompt if self.options.capture_prompts else None)
        self.awaiting.setdefault(decision.chosen, {})[decision.id] = ex.started
        if ex.observe == "async" or (not ex.observe and self.options.observe_responses
                                     and self.options.observe_async):
            self.live[decision.id] = ex
            self._release_unobserved(ex.started)
        return decision

    def _route_within(self, req: Any, only: Collection[str]) -> Decision:
        """Route with every worker outside ``only`` out of the running. The router is
        single-threaded and this is synchronous: the workers' ready flags are lowered for
        this one decision and restored before anything else runs."""
        pool = self.router.pool_for(req.model)
        hidden = [w for a, w in pool.workers.items() if w.ready and a not in only]
        if len(hidden) == sum(1 for w in pool.workers.values() if w.ready):
            raise RoutingError(503, "no endpoint of the proxy's subset hint is a ready worker "
                                    f"of pool {pool.name!r}", code="no_healthy_worker")
        for w in hidden:
            w.ready = False
        try:
            decision = self.router.route(req, self.clock())
        except RoutingError as err:  # the subset's workers are full or unobserved
            raise RoutingError(503, f"no endpoint of the proxy's subset hint is eligible: "
                                    f"{err.message}", code="no_healthy_worker") from None
        finally:
            for w in hidden:
                w.ready = True
        for c in decision.candidates:  # the record says why they were not candidates
            if c.worker not in only:
                c.filtered = "subset"
        return decision

    def any_worker(self, only: Collection[str] | None = None) -> str | None:
        """A request that is not inference (GET /v1/models, /health) goes to any ready
        worker, in turn (of ``only``, when the proxy hints a subset)."""
        ready = sorted(addr for pool in self.router.pools.values()
                       for addr, w in pool.workers.items()
                       if w.ready and (only is None or addr in only))
        if not ready:
            return None  # nothing to send it to
        self._passthrough_seq += 1
        self.metrics.passthrough.inc()
        return ready[self._passthrough_seq % len(ready)]

    # -- observation --------------------------------------------------------------------------
    def observe(self, ex: Exchange | None, msg: ep.ProcessingRequest) -> Exchange | None:
        """One message of an observing stream (Envoy does not wait for an answer). The first,
        the request headers, names the decision: returns the exchange the stream takes over
        (None: not a routed request, nothing to observe)."""
        kind = msg.WhichOneof("request")
        if kind == "request_headers":
            return self._bind(msg)
        if ex is None and kind == "response_headers":  # no request headers: bind here
            ex = self._bind(msg)
        if ex is None:
            return None
        if kind == "response_headers":
            self._response_headers(ex, msg.response_headers)
        elif kind == "response_body":
            self._response_body(ex, msg.response_body)
        return ex

    def _bind(self, msg: ep.ProcessingRequest) -> Exchange | None:
        """The routed exchange whose decision id this message carries: in the envoy.lb
        metadata Envoy forwards (a body-only routing answer set it), else in the headers
        (request headers: set by the routing stream; response headers: added by the route)."""
        decision_id = lb_value(msg, DECISION_KEY)
        if decision_id is None:
            headers = (msg.request_headers if msg.HasField("request_headers")
                       else msg.response_headers)
            decision_id = next((header_value(h) for h in headers.headers.headers
                                if h.key == DECISION_HEADER), None)
        ex = None if decision_id is None else self.live.get(decision_id)
        if ex is not None:
            ex.observed = True
            self.unobserved.pop(decision_id, None)
        return ex

    def stream_ended(self, ex: Exchange | None, *, observing: bool = False) -> None:
        """A stream closed. A routing stream hands a routed exchange over to its observing
        stream (which ends it); otherwise the request is over, however it ended."""
        if ex is None or ex.done:
            return
        d = ex.decision
        if not observing and d is not None and not ex.sees_response and d.id in self.live:
            if not ex.observed:  # not yet taken over: wait for the observing stream
                ex.handed_over = self.clock()
                self.unobserved[d.id] = ex
            return  # the observing stream (or, failing that, the sweep) releases it
        self.finish(ex, aborted=True)

    def _release_unobserved(self, now: float) -> None:
        """Release routed requests no observing stream took over within ``unobserved_after_s``
        of their routing stream's end (oldest first)."""
        limit = self.options.unobserved_after_s
        while self.unobserved:
            ex = next(iter(self.unobserved.values()))
            if now - ex.handed_over < limit:
                return
            if not ex.done:
                log.warning("no observing stream for decision %s after %.0fs; released as "
                            "aborted (is Envoy's config the gateway's?)",
                            ex.decision.id if ex.decision else "?", limit)
                self.finish(ex, aborted=True)
            else:
                self.unobserved.popitem(last=False)

    def _error(self, err: RequestError) -> ep.ProcessingResponse:
        self.count_error(err)
        return immediate(err)

    def count_error(self, err: RequestError) -> None:
        self.metrics.request_error(err.status)

    def _why_no_worker(self, err: RoutingError) -> RoutingError:
        """A 503 names the workers that are down and why (unreachable, stalled), and says
        when to retry: the next scrape may find them back."""
        if err.status != 503:
            return err
        down = [f"{a}: {'; '.join(w.down.values())}" for p in self.router.pools.values()
                for a, w in p.workers.items() if w.down]
        message = err.message + (f" (down: {', '.join(down)})" if down else "")
        return RoutingError(503, message, code=err.code, retry_after_s=1.0)

    def stalled(self, now: float, after_s: float) -> dict[str, str]:
        """Workers whose oldest request has waited ``after_s`` for a first byte while the
        worker answered no request at all for as long: why, by worker. (Called every second
        or so: it also releases routed requests no observing stream ever took over.)"""
        self._release_unobserved(now)
        out: dict[str, str] = {}
        for worker, waiting in self.awaiting.items():
            if not waiting:
                continue
            oldest = now - min(waiting.values())
            if oldest > after_s and now - self.last_first_byte.get(worker, 0.0) > after_s:
                out[worker] = (f"stalled: no first byte for {oldest:.1f}s "
                               f"({len(waiting)} requests waiting)")
        return out

    # -- response -----------------------------------------------------------------------------
    def _response_headers(self, ex: Exchange, msg: ep.HttpHeaders) -> ep.ProcessingResponse:
        status = answered_by = error = None
        for h in msg.headers.headers:
            if h.key == ":status":
                status = header_value(h)
            elif h.key == WORKER_HEADER:
                answered_by = header_value(h)
            elif h.key == ERROR_HEADER:
                error = header_value(h)
        self.response_started(ex, status, answered_by, error, msg.end_of_stream)
        d = ex.decision
        if d is None:
            return ep.ProcessingResponse(response_headers=ep.HeadersResponse())
        return ep.ProcessingResponse(response_headers=ep.HeadersResponse(response=ep.CommonResponse(
            header_mutation=header_mutation({DECISION_HEADER: d.id}))))

    def response_started(self, ex: Exchange, status: str | None, answered_by: str | None,
                         error: str | None, end_of_stream: bool) -> None:
        """The response's headers: its status, the worker the proxy says answered it, the
        reason the proxy gives for an error reply of its own."""
        now = self.clock()
        if status is not None:
            ex.status = int(status) if status.isdigit() else None
        ex.answered_by = answered_by or ex.answered_by
        d = ex.decision
        if d is None:
            return
        self.awaiting.get(d.chosen, {}).pop(d.id, None)
        failed_over = bool(answered_by) and answered_by != d.chosen
        if failed_over or error == "worker_unreachable":
            # Envoy could not reach the chosen worker: no more requests until a scrape
            # finds it back.
            why = f"Envoy could not connect{f'; {answered_by} answered' if failed_over else ''}"
            self._pool_of(d).set_down(d.chosen, "connect", why)
        ex.model_output = (ex.status is not None and 200 <= ex.status < 300
                           and not failed_over)
        if ex.model_output:
            ex.first_byte_s = now - ex.started
            self.last_first_byte[d.chosen] = now
            if not ex.stream:  # a non-streamed answer arrives whole: headers = first token
                self.router.first_token(d)
        if end_of_stream:
            self.finish(ex)

    def _pool_of(self, d: Decision) -> Any:
        return self.router.pools.get(d.pool) or _NoPool()

    def _response_body(self, ex: Exchange, msg: ep.HttpBody) -> ep.ProcessingResponse:
        self.response_chunk(ex, msg.body, msg.end_of_stream)
        return ep.ProcessingResponse(response_body=ep.BodyResponse())

    def response_chunk(self, ex: Exchange, data: bytes, end_of_stream: bool) -> None:
        """A piece of the response body: the first token's time, the worker's cached-token
        count; the last piece ends the request."""
        d = ex.decision
        if d is None:
            return
        if ex.first_token_s is None and data and ex.model_output:
            ex.first_token_s = self.clock() - ex.started
            # Streamed: a real first token, the policy and plugins learn from it.
            self.router.first_token(d, ex.first_token_s * 1000.0 if ex.stream else None)
        window = ex.tail + data
        found = _CACHED_RE.findall(window) or _CACHE_N_RE.findall(window)
        if found:
            ex.cached_tokens = int(found[-1])
        ex.tail = window[-_TAIL:]
        if end_of_stream:
            self.finish(ex)

    def finish(self, ex: Exchange, aborted: bool = False) -> None:
        """Release the worker slot once, and report the outcome."""
        if ex.done or ex.decision is None:
            return
        ex.done = True
        d = ex.decision
        self.awaiting.get(d.chosen, {}).pop(d.id, None)
        self.live.pop(d.id, None)
        self.unobserved.pop(d.id, None)
        ttft_s = ex.first_token_s if ex.stream else ex.first_byte_s
        outcome = Outcome(status=ex.status, aborted=aborted,
                          ttft_ms=None if ttft_s is None else ttft_s * 1000.0,
                          ttft_kind=FIRST_TOKEN if ex.stream else FIRST_BYTE,
                          cached_tokens=ex.cached_tokens)
        self.router.release(d, outcome)
        if not self.options.observe_responses:
            return
        # Only a streamed response that was not aborted has a real first token.
        self.metrics.outcome(d, status=ex.status, cached_tokens=ex.cached_tokens,
                             first_token_s=ttft_s if ex.stream and not aborted else None)
        fields: dict[str, Any] = {}
        if ex.answered_by is not None:
            fields["answered_by"] = ex.answered_by
        self.sink.outcome(d.id, status=outcome.status, aborted=aborted, ttft_ms=outcome.ttft_ms,
                          ttft_kind=outcome.ttft_kind, first_byte_ms=None if ex.first_byte_s is None
                          else ex.first_byte_s * 1000.0,
                          cached_tokens=ex.cached_tokens, completed_at=self.clock(), **fields)
