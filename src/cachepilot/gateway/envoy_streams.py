"""CachePilot's own Envoy config, as streams: Envoy's messages in, the director's calls out.

Routing stream (one per request; Envoy waits for its answers). By default (gRPC metadata
``x-cachepilot-body: only``) it carries one message, the whole request body: Envoy's route
matched the method and path (named in ``x-cachepilot-path``) and refused declared lengths
over the limit, so the gateway parses, routes and answers once, with the ordered fallback
list, the chosen worker and the decision id in ``envoy.lb`` metadata, or with a JSON error
(ImmediateResponse). Other configurations are understood too: a headers message first
(``x-cachepilot-body: buffered``: the headers answered at once, the body's answer routes
with the destination header as well), a STREAMED body (the headers answered at the last
chunk, then one answer per chunk), and a routing stream that also carries the response
(``x-cachepilot-observe: sync``).

Observing stream (``observability_mode``: Envoy sends and never waits). Its first message
names the decision (forwarded ``envoy.lb`` metadata, or a header); the :class:`Handover`
gives it the routed exchange, whose response it then feeds to the director. A routed
exchange no observing stream takes over within ``unobserved_after_s`` is released as
aborted (:meth:`Handover.sweep`).

Observing until the first token (``x-cachepilot-observe: first-token``, Envoy's default
config): the gateway closes the observing stream once the first token has come (Envoy then
sends it nothing more; grpc.aio costs ~40 µs a message, and a streamed answer is one message
per event), and Envoy's access log entry, at the response's end, ends the exchange with its
status and the usage Envoy's Lua filter read (:meth:`EnvoyStreams.logged`). One whose entry
will not come is released as aborted: ``logged_grace_s`` after Envoy ended the request (the
routing stream stays open until then; an Envoy that dies closes them all), or after
``unlogged_after_s``.
An answer that is not streamed has no observing stream at all (:func:`_log_only`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from envoy.data.accesslog.v3 import accesslog_pb2 as al
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from cachepilot.core.decision import Decision
from cachepilot.core.flow.classify import header_names
from cachepilot.core.flow.queue import Ticket
from cachepilot.core.request import RequestError
from cachepilot.gateway.director import (
    Director,
    Exchange,
    GatewayOptions,
    Pending,
    Phase,
    Turn,
)
from cachepilot.gateway.handover import Handover
from cachepilot.gateway.protocol import (
    CHOSEN_KEY,
    DECISION_HEADER,
    DECISION_KEY,
    DESTINATION_HEADER,
    ERROR_HEADER,
    FIRST_TOKEN,
    LB_METADATA_NAMESPACE,
    UNOBSERVED_KEY,
    USAGE_NAMESPACE,
    WORKER_HEADER,
    attribute_headers,
    fallback_list,
    header_mutation,
    header_value,
    immediate,
    lb_metadata,
    lb_value,
    request_line,
    some_headers,
)

log = logging.getLogger("cachepilot.gateway")

_CONTINUE_HEADERS = ep.ProcessingResponse(request_headers=ep.HeadersResponse())
Answers = list[ep.ProcessingResponse] | Pending[ep.ProcessingResponse]


@dataclass
class RoutingStream:
    """One routing stream: its exchange and how Envoy's config says it flows."""

    ex: Exchange = field(default_factory=Exchange)
    buffered: bool = False  # the body comes whole, after the headers' (immediate) answer
    body_only: bool = False  # no headers message: the whole body is the stream's first
    # "async", "first-token", "sync" or "off", as Envoy's config says ("": the default)
    observe: str = ""
    sees_response: bool = False  # the response came on this stream
    body: bytearray = field(default_factory=bytearray)
    chunks: int = 0  # request body messages not yet answered
    headers: dict[str, str] = field(default_factory=dict)  # what flow control reads


class EnvoyStreams:
    """Our protocol's adapter: routing and observing streams over one :class:`Director`."""

    def __init__(self, director: Director) -> None:
        self.director = director
        self.handover = Handover()
        flow = director.flow
        self.flow_headers = frozenset(header_names(flow.config)) if flow else frozenset()

    @property
    def options(self) -> GatewayOptions:
        return self.director.options

    # -- routing stream -----------------------------------------------------------------------
    def handle(self, s: RoutingStream, msg: ep.ProcessingRequest) -> Answers:
        """Answer one message from Envoy: zero or more responses, in the order Envoy expects,
        or (a request flow control holds) a :class:`Pending` the servicer awaits."""
        kind = msg.WhichOneof("request")
        if self.flow_headers and not s.headers and kind in ("request_headers", "request_body"):
            s.headers = attribute_headers(msg)
        if kind == "request_headers":
            if self.flow_headers:
                s.headers.update(some_headers(msg.request_headers, self.flow_headers))
            return self._request_headers(s, msg.request_headers)
        if kind == "request_body":
            if s.body_only:
                return self._whole_body(s, msg.request_body)
            return self._request_body(s, msg.request_body)
        if kind == "response_headers":
            if s.ex.decision is not None:  # the routing stream carries the response itself
                s.sees_response = True
            return [self._response_headers(s.ex, msg.response_headers)]
        if kind == "response_body":
            self.director.response_chunk(s.ex, msg.response_body.body,
                                         msg.response_body.end_of_stream)
            return [ep.ProcessingResponse(response_body=ep.BodyResponse())]
        if kind == "request_trailers":
            return [ep.ProcessingResponse(request_trailers=ep.TrailersResponse())]
        if kind == "response_trailers":
            return [ep.ProcessingResponse(response_trailers=ep.TrailersResponse())]
        raise RequestError(400, f"unexpected ext_proc message {kind!r}")

    def _request_headers(self, s: RoutingStream, msg: ep.HttpHeaders
                         ) -> list[ep.ProcessingResponse]:
        method, path, length = request_line(msg)
        err = self.director.begin(s.ex, method, path, length, end_of_stream=msg.end_of_stream)
        if err is not None:
            return [immediate(err)]
        if not s.ex.inference:  # GET /v1/models, /health, …: any ready worker answers
            target = self.director.any_worker(s.ex)
            return [ep.ProcessingResponse(request_headers=ep.HeadersResponse(
                response=ep.CommonResponse() if target is None else ep.CommonResponse(
                    header_mutation=header_mutation({DESTINATION_HEADER: target}),
                    clear_route_cache=True)))]
        if s.buffered:  # Envoy sends the body once the headers are answered
            return [_CONTINUE_HEADERS]
        return []  # answered with the destination once the body is complete

    def _whole_body(self, s: RoutingStream, msg: ep.HttpBody) -> Answers:
        """Body-only routing: the stream's one message is the whole body of a POST to the
        path Envoy's route named. The answer routes through envoy.lb metadata; Envoy's buffer
        filter holds the headers until it comes, and clearing the route cache lets the route
        see the metadata."""
        d = self.director
        ex = s.ex
        if ex.phase is not Phase.NEW:  # answered already: a re-delivered body (envoy #46237)
            return []
        d.begin(ex, "POST", ex.path)
        if not ex.inference:
            return [immediate(d.fail(ex, RequestError(
                500, f"Envoy's route names no inference path for this body ({ex.path!r}); "
                     "is its config the gateway's?", code="proxy_config")))]
        err = d.check_size(ex, len(msg.body))
        if err is None and not msg.body:
            err = d.fail(ex, RequestError(400, "request body is empty"))
        if err is not None:
            return [immediate(err)]
        try:
            routed = self._route(s, msg.body)
        except RequestError as err:
            return [immediate(err)]
        return self._answer(s, routed, _body_only_answer)

    def _request_body(self, s: RoutingStream, msg: ep.HttpBody) -> Answers:
        if s.ex.phase is Phase.HELD:  # a chunk re-delivered while held: answered with it
            s.chunks += 1
            return []
        if not s.ex.inference or s.ex.phase is not Phase.NEW:
            # Not inference; or the body already ended and was routed once: a chunk Envoy
            # re-delivers after the end (envoy #46237, GIE #2988) is answered like any
            # STREAMED chunk (one answer per message) and never parsed or routed again.
            return [ep.ProcessingResponse(request_body=ep.BodyResponse())]
        s.chunks += 1
        if msg.end_of_stream and not s.body:  # the whole body in one message: no copy
            raw = msg.body
        else:
            s.body += msg.body
            raw = bytes(s.body) if msg.end_of_stream else b""
        err = self.director.check_size(s.ex, len(raw or s.body))
        if err is not None:
            return [immediate(err)]
        if not msg.end_of_stream:
            return []
        s.body = bytearray()
        try:
            routed = self._route(s, raw)
        except RequestError as err:
            return [immediate(err)]
        return self._answer(s, routed, _routed_body_answers)

    def _route(self, s: RoutingStream, raw: bytes) -> Decision | Ticket | Turn:
        routed = self.director.route(s.ex, raw, unparseable_by_load=True, headers=s.headers)
        if isinstance(routed, Decision):
            self._routed(s, routed)
        return routed

    def _routed(self, s: RoutingStream, decision: Decision) -> None:
        """A routed exchange: its observing stream will take it over, or (not streamed,
        observed until the first token) Envoy's access log alone ends it."""
        opts = self.options
        if s.observe in ("async", FIRST_TOKEN) or (not s.observe and opts.observe_responses
                                                   and opts.observe_async):
            self.handover.expect(decision, s.ex, self.director.clock(),
                                 logged=s.observe == FIRST_TOKEN,
                                 observed=not _log_only(s))
            self.sweep(s.ex.started)  # also here: the stall watch may be off

    def _answer(self, s: RoutingStream, routed: Decision | Ticket | Turn,
                build: Callable[[RoutingStream, Decision], list[ep.ProcessingResponse]]
                ) -> Answers:
        """The routing answer now, or once the held request is dispatched."""
        if isinstance(routed, Decision):
            return build(s, routed)

        def then(decision: Decision) -> list[ep.ProcessingResponse]:
            self._routed(s, decision)
            return build(s, decision)

        return Pending(self.director, s.ex, routed, then, lambda err: [immediate(err)])

    def awaits_end(self, s: RoutingStream) -> bool:
        """Whether the routing stream stays open after its answer until Envoy ends the
        request: routed for Envoy's access log to end (observed until the first token), its
        close is the request's end however it ended, and bounds the wait for the entry."""
        d = s.ex.decision
        return d is not None and not s.ex.done and d.id in self.handover.unlogged

    def routing_ended(self, s: RoutingStream) -> None:
        """A routing stream closed. A routed exchange waits for its observing stream (which
        ends it) or, with none, for its access log entry (due now: Envoy ended the request);
        otherwise the request is over, however it ended."""
        ex, d = s.ex, s.ex.decision
        if d is not None and not ex.done and not s.sees_response:
            if d.id in self.handover.unlogged:  # Envoy ended the request: its entry is due
                self.director.ended(ex)
                self.handover.ended[d.id] = (ex, self.director.clock())
                return
            if d.id in self.handover.live:
                self.handover.park(d, ex, self.director.clock())
                return
        if d is not None:
            self.handover.forget(d)
        self.director.finish(ex, aborted=True)

    # -- observing stream ---------------------------------------------------------------------
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
            self._response_started(ex, msg.response_headers)  # nobody reads an answer
        elif kind == "response_body":
            self.director.response_chunk(ex, msg.response_body.body,
                                         msg.response_body.end_of_stream)
        return ex

    def observing_ended(self, ex: Exchange | None) -> None:
        """An observing stream closed: its request is over, however it ended; unless the
        gateway closed it at the first token, and Envoy's access log will say how it ended."""
        if ex is None or ex.done:
            return
        d = ex.decision
        if d is not None and ex.first_token_s is not None and d.id in self.handover.unlogged:
            return
        self.director.finish(ex, aborted=True)

    def logged(self, entry: al.HTTPAccessLogEntry) -> None:
        """Envoy's access log entry for a request, at its end: ends the exchange it names
        (observed until the first token) with the response's status, the worker that
        answered and the usage Envoy's Lua filter read from the answer's end."""
        common = entry.common_properties
        meta = common.metadata.filter_metadata
        decision_id = None
        if LB_METADATA_NAMESPACE in meta:
            field = meta[LB_METADATA_NAMESPACE].fields.get(DECISION_KEY)
            decision_id = field.string_value if field is not None else None
        decision_id = decision_id or entry.request.request_headers.get(DECISION_HEADER)
        ex = self.handover.logged(decision_id) if decision_id else None
        if ex is None:
            return
        usage = meta[USAGE_NAMESPACE].fields if USAGE_NAMESPACE in meta else {}
        upstream = common.upstream_remote_address.socket_address
        now = self.director.clock()

        def count(key: str) -> int | None:
            v = usage.get(key)
            return None if v is None else int(v.number_value)

        self.director.logged_end(
            ex, status=entry.response.response_code.value or None,
            answered_by=f"{upstream.address}:{upstream.port_value}" if upstream.address else None,
            cached_tokens=count("cached_tokens"), completion_tokens=count("completion_tokens"),
            aborted=_cut_short(common.response_flags),
            first_byte_at=_after_body(ex, common, "time_to_first_upstream_rx_byte", now),
            ended_at=_after_body(ex, common, "time_to_last_downstream_tx_byte", now),
            error=entry.response.response_headers.get(ERROR_HEADER))

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
        return self.handover.take(decision_id)

    def sweep(self, now: float) -> None:
        """Release routed requests no observing stream took over in time, and those whose
        access log entry never came (oldest first)."""
        h, o = self.handover, self.options
        for released, level, why, limit in (
                (h.sweep(now, o.unobserved_after_s), logging.WARNING,
                 "no observing stream after %.0fs (is Envoy's config the gateway's?)",
                 o.unobserved_after_s),
                # Common: a client that left before the routing answer applied.
                (h.sweep_ended(now, o.logged_grace_s), logging.INFO,
                 "the request ended %.0fs ago with no access log entry", o.logged_grace_s),
                (h.sweep_unlogged(now, o.unlogged_after_s), logging.WARNING,
                 "no access log entry after %.0fs (does Envoy's access log reach the "
                 "gateway?)", o.unlogged_after_s)):
            for ex in released:
                log.log(level, "decision %s: " + why + "; released as aborted",
                        ex.decision.id if ex.decision else "?", limit)
                self.director.finish(ex, aborted=True)

    # -- response (either stream) -------------------------------------------------------------
    def _response_headers(self, ex: Exchange, msg: ep.HttpHeaders) -> ep.ProcessingResponse:
        """The routing stream's answer to the response headers: the decision id added."""
        self._response_started(ex, msg)
        d = ex.decision
        if d is None:
            return ep.ProcessingResponse(response_headers=ep.HeadersResponse())
        return ep.ProcessingResponse(response_headers=ep.HeadersResponse(response=ep.CommonResponse(
            header_mutation=header_mutation({DECISION_HEADER: d.id}))))

    def _response_started(self, ex: Exchange, msg: ep.HttpHeaders) -> None:
        """The response's status, the worker Envoy says answered, and Envoy's own error."""
        status = answered_by = error = None
        for h in msg.headers.headers:
            if h.key == ":status":
                status = header_value(h)
            elif h.key == WORKER_HEADER:
                answered_by = header_value(h)
            elif h.key == ERROR_HEADER:
                error = header_value(h)
        self.director.response_started(ex, status, answered_by, error, msg.end_of_stream)


def _after_body(ex: Exchange, common: al.AccessLogCommon, timing: str, now: float) -> float:
    """When, on the gateway's clock, one of Envoy's timings came (the worker's first byte,
    the response's last): after the request body's last byte (when Envoy sent it to the
    gateway, just before the exchange started) by the time Envoy reports between the two.
    The entry's own arrival would add the access log's delivery (up to its flush interval:
    Envoy sends entries in batches). ``now`` if Envoy has no such timing (the worker sent
    nothing)."""
    if not (common.HasField(timing) and common.HasField("time_to_last_rx_byte")):
        return now
    after = (getattr(common, timing).ToTimedelta()
             - common.time_to_last_rx_byte.ToTimedelta()).total_seconds()
    return min(now, ex.started + max(0.0, after))


def _cut_short(flags: al.ResponseFlags) -> bool:
    """Whether Envoy's response flags say the exchange was cut short: the client left, or a
    side reset or went idle mid-way (Envoy's own error replies, a 503 when no worker could be
    reached or a 504 when none answered in time, are answers like any other, as the
    observing stream sees them)."""
    return any((flags.downstream_connection_termination, flags.downstream_remote_reset,
                flags.upstream_remote_reset, flags.upstream_connection_termination,
                flags.local_reset, flags.stream_idle_timeout, flags.duration_timeout))


def _body_only_answer(s: RoutingStream, decision: Decision) -> list[ep.ProcessingResponse]:
    """Envoy applies no header mutation here (it sent no headers), but its default route
    cache action clears the cache only for an answer that has one: this one makes the route
    see the metadata (fail-open's picked route)."""
    return [ep.ProcessingResponse(
        request_body=ep.BodyResponse(response=_routed(decision)),
        dynamic_metadata=lb_metadata(fallback_list(decision), **{
            DECISION_KEY: decision.id, CHOSEN_KEY: decision.chosen}, **_unobserved(s)))]


def _log_only(s: RoutingStream) -> bool:
    """Observed until the first token and not streamed: the first byte is the end, which
    Envoy's access log reports; no observing stream is needed (Envoy's route skips it)."""
    return s.observe == FIRST_TOKEN and not s.ex.stream


def _unobserved(s: RoutingStream) -> dict[str, str]:
    return {UNOBSERVED_KEY: "1"} if _log_only(s) else {}


def _routed_body_answers(s: RoutingStream, decision: Decision) -> list[ep.ProcessingResponse]:
    """The answers to a routed body: its own (BUFFERED: it carries the routing), or the
    headers' (carrying the routing) and one per body chunk (STREAMED)."""
    common = _routed(decision)
    metadata = lb_metadata(fallback_list(decision), **_unobserved(s))
    if s.buffered:  # the headers wait for the body's answer, which carries the routing
        s.chunks = 0
        return [ep.ProcessingResponse(request_body=ep.BodyResponse(response=common),
                                      dynamic_metadata=metadata)]
    out = [ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common),
                                 dynamic_metadata=metadata)]
    out += [ep.ProcessingResponse(request_body=ep.BodyResponse())] * s.chunks
    s.chunks = 0
    return out


def _routed(d: Decision) -> ep.CommonResponse:
    """The routing answer's common part: the destination and decision id headers, and a
    cleared route cache so the route sees them (and any envoy.lb metadata beside them)."""
    return ep.CommonResponse(header_mutation=header_mutation(
        {DESTINATION_HEADER: d.chosen, DECISION_HEADER: d.id}), clear_route_cache=True)
