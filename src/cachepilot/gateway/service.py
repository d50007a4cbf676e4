"""Envoy's ExternalProcessor streams, as a small state machine.

Two kinds of stream, told apart by the gRPC metadata Envoy's per-route config adds
(``x-cachepilot-role: observe`` on an observing stream):

Routing stream (one per request; Envoy waits for its answers). Request headers → note
method, path, content length; non-inference requests are answered at once (any ready worker).
For inference requests the answer waits for the body: Envoy streams it without waiting for
that answer (``send_body_without_waiting_for_header_response``), so routing costs one round
trip. At the last body chunk: parse, route, and answer the headers with the destination
header, the ordered fallback list (``envoy.lb`` metadata) and the decision id (then one empty
answer per chunk), or answer with a JSON error (ImmediateResponse). With a BUFFERED body
(metadata ``x-cachepilot-body: buffered``, the default bootstrap) the headers are answered at
once, Envoy holds them and sends the whole body as one message, and that message's answer
carries the routing: two messages each way whatever the body's size, where STREAMED answers
one per chunk, each send a wake-up of the event loop. (Skipping the headers message does not
work: Envoy then passes the headers on to the router before the body arrives, so the
destination would come too late.) A routing stream that also carries the response
(``observe_async`` off in Envoy's config) is understood too.

Observing stream (``observability_mode``: Envoy sends and never waits, so observation costs
the client nothing). The request headers carry the decision id the routing stream set; then
response headers (status, who answered: failover, first byte) and response body chunks
(first token time, the worker's cached-token count). Only a 2xx answer from the chosen worker
is model output: an error, or an answer from the runner-up Envoy failed over to, never counts
as the chosen worker's first token. The response's end, or the stream's end however it ends,
releases the request's place on its worker and records the outcome.
"""

from __future__ import annotations

import logging
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from cachepilot.core.decision import Decision, RoutingError
from cachepilot.core.lifecycle import FIRST_BYTE, FIRST_TOKEN, Outcome
from cachepilot.core.request import RequestError, inference_path, parse_openai_body
from cachepilot.core.router import Router
from cachepilot.gateway.gateway_metrics import GatewayMetrics
from cachepilot.records import NullRecorder

log = logging.getLogger("cachepilot.extproc")

DESTINATION_HEADER = "x-gateway-destination-endpoint"  # as the Gateway API Inference Extension
# Where the ordered list (chosen worker first, then the runner-ups) goes, as the inference
# extension's endpoint picker writes it: dynamic metadata envoy.lb/<DESTINATION_HEADER>.
LB_METADATA_NAMESPACE = "envoy.lb"
DECISION_HEADER = "x-cachepilot-decision-id"
# Set by Envoy on every answer to the worker that answered (%UPSTREAM_HOST%).
WORKER_HEADER = "x-cachepilot-worker"
# Set by Envoy on its own replies that say why (e.g. worker_unreachable).
ERROR_HEADER = "x-cachepilot-error"
FALLBACKS = 2  # runner-ups after the chosen worker in the list Envoy's retries walk
# gRPC metadata Envoy's per-route ext_proc config adds to a stream: an observing stream's
# role, and a routing stream whose body comes BUFFERED (one message, after the headers'
# answer) rather than STREAMED.
ROLE_METADATA = "x-cachepilot-role"
OBSERVE_ROLE = "observe"
BODY_METADATA = "x-cachepilot-body"
BUFFERED_BODY = "buffered"
# How the routing stream's request will be observed, as Envoy's config says: "async" (an
# observing stream takes it over), "sync" (the routing stream carries the response), "off".
OBSERVE_METADATA = "x-cachepilot-observe"

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_CACHED_RE = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_CACHE_N_RE = re.compile(rb'"cache_n"\s*:\s*(\d+)')  # llama.cpp /completion timings
_TAIL = 512  # bytes of the previous chunk kept so a split "cached_tokens" is still found


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


def _headers(pairs: dict[str, str]) -> ep.HeaderMutation:
    return ep.HeaderMutation(set_headers=[
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
                                   append_action=_OVERWRITE)
        for k, v in pairs.items()])


def fallback_list(d: Decision) -> str:
    """The chosen worker, then up to FALLBACKS eligible runner-ups, best first."""
    rest = sorted((c for c in d.candidates if c.eligible and c.worker != d.chosen),
                  key=lambda c: -c.value)
    return ",".join([d.chosen, *(c.worker for c in rest[:FALLBACKS])])


_CONTINUE_HEADERS = ep.ProcessingResponse(request_headers=ep.HeadersResponse())


def _lb_metadata(destinations: str) -> struct_pb2.Struct:
    md = struct_pb2.Struct()
    md.update({LB_METADATA_NAMESPACE: {DESTINATION_HEADER: destinations}})
    return md


class _NoPool:
    def set_down(self, *_: object) -> None:
        pass


def immediate(err: RequestError) -> ep.ProcessingResponse:
    """A JSON error straight back to the client; Envoy never contacts a worker."""
    hdrs = {"content-type": "application/json"}
    if err.retry_after_s is not None:
        hdrs["retry-after"] = str(int(err.retry_after_s))
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=err.status), headers=_headers(hdrs),
        body=err.to_json(), details=f"cachepilot_{err.code}"))


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
    observe: str = ""  # as Envoy's config says on the stream ("async", "sync", "off"), or ""


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
    def _request_headers(self, ex: Exchange, msg: ep.HttpHeaders) -> list[ep.ProcessingResponse]:
        ex.started = self.clock()
        for h in msg.headers.headers:
            value = h.raw_value.decode("latin-1") if h.raw_value else h.value
            if h.key == ":path":
                ex.path = value
            elif h.key == ":method":
                ex.method = value
            elif h.key == "content-length":
                ex.content_length = int(value) if value.isdigit() else None
        ex.inference = bool(inference_path(ex.path)) and ex.method == "POST"
        if not ex.inference:  # GET /v1/models, /health, …: any ready worker answers
            return [ep.ProcessingResponse(request_headers=ep.HeadersResponse(
                response=self._passthrough()))]
        limit = self.options.max_body_bytes
        if ex.content_length is not None and ex.content_length > limit:
            return [self._error(RequestError(
                413, f"request body is {ex.content_length} bytes; the limit is {limit}",
                code="body_too_large"))]
        if msg.end_of_stream:
            return [self._error(RequestError(400, "request body is empty"))]
        if ex.buffered:  # Envoy sends the body once the headers are answered
            return [_CONTINUE_HEADERS]
        return []  # answered with the destination once the body is complete

    def _request_body(self, ex: Exchange, msg: ep.HttpBody) -> list[ep.ProcessingResponse]:
        if not ex.inference:
            return [ep.ProcessingResponse(request_body=ep.BodyResponse())]
        ex.chunks += 1
        if msg.end_of_stream and not ex.body:  # the whole body in one message: no copy
            raw = msg.body
        else:
            ex.body += msg.body
            raw = bytes(ex.body) if msg.end_of_stream else b""
        if len(raw or ex.body) > self.options.max_body_bytes:
            return [self._error(RequestError(
                413, f"request body exceeds the limit of {self.options.max_body_bytes} bytes",
                code="body_too_large"))]
        if not msg.end_of_stream:
            return []
        t0 = time.perf_counter()
        try:
            req = parse_openai_body(ex.path, raw)
            decision = self.router.route(req, self.clock())
        except RoutingError as err:
            return [self._error(self._why_no_worker(err))]
        except RequestError as err:
            return [self._error(err)]
        finally:
            ex.body = bytearray()
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
        mutation = _headers({DESTINATION_HEADER: decision.chosen, DECISION_HEADER: decision.id})
        common = ep.CommonResponse(header_mutation=mutation, clear_route_cache=True)
        metadata = _lb_metadata(fallback_list(decision))
        if ex.buffered:  # the headers wait for the body's answer, which carries the routing
            ex.chunks = 0
            return [ep.ProcessingResponse(request_body=ep.BodyResponse(response=common),
                                          dynamic_metadata=metadata)]
        out = [ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common),
                                     dynamic_metadata=metadata)]
        out += [ep.ProcessingResponse(request_body=ep.BodyResponse())] * ex.chunks
        ex.chunks = 0
        return out

    # -- observation --------------------------------------------------------------------------
    def observe(self, ex: Exchange | None, msg: ep.ProcessingRequest) -> Exchange | None:
        """One message of an observing stream (Envoy does not wait for an answer). The first,
        the request headers, names the decision: returns the exchange the stream takes over
        (None: not a routed request, nothing to observe)."""
        kind = msg.WhichOneof("request")
        if kind == "request_headers":
            return self._bind(msg.request_headers)
        if ex is None and kind == "response_headers":  # no request headers: bind here
            ex = self._bind(msg.response_headers)
        if ex is None:
            return None
        if kind == "response_headers":
            self._response_headers(ex, msg.response_headers)
        elif kind == "response_body":
            self._response_body(ex, msg.response_body)
        return ex

    def _bind(self, msg: ep.HttpHeaders) -> Exchange | None:
        """The routed exchange whose decision id these headers carry (request headers: set by
        the routing stream; response headers: added by Envoy's route)."""
        for h in msg.headers.headers:
            if h.key == DECISION_HEADER:
                did = h.raw_value.decode("latin-1") if h.raw_value else h.value
                ex = self.live.get(did)
                if ex is not None:
                    ex.observed = True
                    self.unobserved.pop(did, None)
                return ex
        return None

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

    def _passthrough(self) -> ep.CommonResponse:
        """Non-inference requests go to any ready worker, in turn."""
        ready = sorted(addr for pool in self.router.pools.values()
                       for addr, w in pool.workers.items() if w.ready)
        if not ready:
            return ep.CommonResponse()  # Envoy answers 503: nothing to send it to
        self._passthrough_seq += 1
        self.metrics.passthrough.inc()
        target = ready[self._passthrough_seq % len(ready)]
        return ep.CommonResponse(header_mutation=_headers({DESTINATION_HEADER: target}),
                                 clear_route_cache=True)

    def _error(self, err: RequestError) -> ep.ProcessingResponse:
        self.metrics.request_error(err.status)
        return immediate(err)

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
        now = self.clock()
        answered_by = error = None
        for h in msg.headers.headers:
            raw = h.raw_value.decode("latin-1") if h.raw_value else h.value
            if h.key == ":status":
                ex.status = int(raw) if raw.isdigit() else None
            elif h.key == WORKER_HEADER:
                answered_by = raw
            elif h.key == ERROR_HEADER:
                error = raw
        d = ex.decision
        if d is None:
            return ep.ProcessingResponse(response_headers=ep.HeadersResponse())
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
        if msg.end_of_stream:
            self.finish(ex)
        return ep.ProcessingResponse(response_headers=ep.HeadersResponse(response=ep.CommonResponse(
            header_mutation=_headers({DECISION_HEADER: d.id}))))

    def _pool_of(self, d: Decision) -> Any:
        return self.router.pools.get(d.pool) or _NoPool()

    def _response_body(self, ex: Exchange, msg: ep.HttpBody) -> ep.ProcessingResponse:
        d = ex.decision
        if d is not None:
            if ex.first_token_s is None and msg.body and ex.model_output:
                ex.first_token_s = self.clock() - ex.started
                # Streamed: a real first token, the policy and plugins learn from it.
                self.router.first_token(d, ex.first_token_s * 1000.0 if ex.stream else None)
            window = ex.tail + msg.body
            found = _CACHED_RE.findall(window) or _CACHE_N_RE.findall(window)
            if found:
                ex.cached_tokens = int(found[-1])
            ex.tail = window[-_TAIL:]
            if msg.end_of_stream:
                self.finish(ex)
        return ep.ProcessingResponse(response_body=ep.BodyResponse())

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
        self.sink.outcome(d.id, status=outcome.status, aborted=aborted, ttft_ms=outcome.ttft_ms,
                          ttft_kind=outcome.ttft_kind, first_byte_ms=None if ex.first_byte_s is None
                          else ex.first_byte_s * 1000.0,
                          cached_tokens=ex.cached_tokens, completed_at=self.clock())


def _stream_kind(context: grpc.aio.ServicerContext | None) -> tuple[str, bool, str]:
    """(role, body buffered, observation) from the metadata Envoy's per-route config adds to
    a stream."""
    role, buffered, observe = "", False, ""
    if context is not None:
        for key, value in context.invocation_metadata() or ():
            if key == ROLE_METADATA:
                role = value
            elif key == BODY_METADATA:
                buffered = value == BUFFERED_BODY
            elif key == OBSERVE_METADATA:
                observe = value
    return role, buffered, observe


class ExtProcServicer(ep_grpc.ExternalProcessorServicer):
    """grpc.aio adapter: one Exchange per stream; never lets an exception kill the server."""

    def __init__(self, processor: Processor) -> None:
        self.processor = processor

    async def Process(self, request_iterator: AsyncIterator[ep.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[ep.ProcessingResponse]:
        role, buffered, observe = _stream_kind(context)
        if role == OBSERVE_ROLE:
            await self._observe(request_iterator)
            return
        ex = Exchange(buffered=buffered, observe=observe)
        try:
            async for msg in request_iterator:
                try:
                    for resp in self.processor.handle(ex, msg):
                        yield resp
                except RequestError as err:
                    yield immediate(err)
                except Exception:  # a bug must cost one request, not the gateway
                    log.exception("ext_proc message failed")
                    yield immediate(RequestError(500, "internal routing error",
                                                 code="internal_error"))
        finally:
            self.processor.stream_ended(ex)

    async def _observe(self, request_iterator: AsyncIterator[ep.ProcessingRequest]) -> None:
        """Envoy sends and never waits for an answer; the gateway ends the stream itself once
        the response is over (Envoy would hold it open for its deferred-close timeout)."""
        p = self.processor
        ex: Exchange | None = None
        try:
            async for msg in request_iterator:
                try:
                    ex = p.observe(ex, msg)
                except Exception:
                    log.exception("ext_proc observation failed")
                if ex is None or ex.done:
                    break
        finally:
            p.stream_ended(ex, observing=True)
