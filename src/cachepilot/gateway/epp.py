"""The Gateway API Inference Extension's endpoint picker protocol over one ext_proc stream.

Any gateway that fronts an InferencePool (Istio, kgateway, Envoy Gateway, GKE, …) speaks it;
docs/epp.md is the rulebook with the upstream files it follows. One stream per HTTP exchange,
every phase on it, bodies FULL_DUPLEX_STREAMED both ways:

* request headers: remember them (``x-request-id`` kept, or generated; the model rewrite
  header) and the proxy's subset hint (filter metadata ``envoy.lb.subset_hint``). A request
  without a body, or not an inference call, is answered at once: any ready worker (of the
  subset).
* request body chunks: buffered (nothing is answered yet, as the reference EPP does); at the
  last one the body is parsed, the model rewritten if asked, and the one core Router picks a
  worker. The answer: the headers response with ``x-gateway-destination-endpoint`` and the
  same value in dynamic metadata ``envoy.lb``, then the body handed back as streamed chunks
  (in full-duplex mode Envoy forwards only what the processor sends back); body messages
  after the end (a duplicate end-of-stream chunk, GIE #2988) are ignored. A request that
  cannot be routed gets an ImmediateResponse: 400 bad body, 404 unknown model, 413 too
  large, 429 every worker full, 503 no eligible endpoint.
* response headers: the proxy reports who served it (``envoy.lb`` /
  ``x-gateway-destination-endpoint-served``); it is recorded as who answered (a failover
  marks the chosen worker down, as in our own mode) and echoed to the client.
* response body chunks: watched for the first token and cached tokens, and streamed back
  (model name rewritten back to the client's; a non-streamed answer is held until complete
  when it needs rewriting, as the reference does).
"""

from __future__ import annotations

import uuid
from collections.abc import Collection

import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from cachepilot.core.decision import Decision
from cachepilot.core.flow.classify import header_names
from cachepilot.core.request import RequestError
from cachepilot.gateway.director import Director, Exchange, Pending
from cachepilot.gateway.protocol import (
    DECISION_HEADER,
    DESTINATION_HEADER,
    LB_METADATA_NAMESPACE,
    MODEL_REWRITE_HEADER,
    REQUEST_ID_HEADER,
    SERVED_KEY,
    SERVED_REPORT_HEADER,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
    WORKER_HEADER,
    header_mutation,
    header_value,
    immediate,
    lb_metadata,
    request_line,
    some_headers,
    streamed_body,
)

Answers = list[ep.ProcessingResponse] | Pending[ep.ProcessingResponse]


def subset_hint(msg: ep.ProcessingRequest) -> frozenset[str] | None:
    """The endpoints the proxy allows (``envoy.lb.subset_hint`` filter metadata), or None
    when it sets no hint. A list of ``ip:port`` (the protocol) or one comma-separated string
    (what a header-to-metadata rule writes), as the reference lightweight EPP reads it."""
    ns = msg.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if ns is None or SUBSET_KEY not in ns.fields:
        return None
    value = ns.fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    items: list[str] = []
    if kind == "string_value":
        items = [value.string_value]
    elif kind == "list_value":
        items = [v.string_value for v in value.list_value.values
                 if v.WhichOneof("kind") == "string_value"]
    return frozenset(p.strip() for item in items for p in item.split(",") if p.strip())


def served_endpoint(msg: ep.ProcessingRequest) -> str | None:
    """Who served the response, as the proxy reports it (``envoy.lb`` filter metadata)."""
    ns = msg.metadata_context.filter_metadata.get(LB_METADATA_NAMESPACE)
    if ns is None or SERVED_KEY not in ns.fields:
        return None
    value = ns.fields[SERVED_KEY]
    if value.WhichOneof("kind") == "string_value":
        return value.string_value or None
    if value.WhichOneof("kind") == "list_value" and value.list_value.values:
        return value.list_value.values[0].string_value or None
    return None


def allowed(workers: Collection[str], hint: frozenset[str]) -> frozenset[str]:
    """The workers a hint names: ``ip:port`` exactly, a bare ``ip`` any of its ports (as the
    reference lightweight EPP matches, pkg/lwepp/handlers/request.go)."""
    return frozenset(a for a in workers
                     if a in hint or a.rpartition(":")[0].strip("[]") in hint)


def _rewrite(body: bytes, old: str, new: str) -> bytes:
    """``"model":"old"`` → ``"model":"new"`` in a response body (the reference's
    rewriteModelName, pkg/epp/handlers/server.go)."""
    if not old or not new or old == new:
        return body
    for sep in (b":", b": "):
        key = b'"model"' + sep
        out = body.replace(key + orjson.dumps(old), key + orjson.dumps(new))
        if out != body:
            return out
    return body


class EppStream:
    """One ext_proc stream in the endpoint picker protocol; :meth:`handle` answers each
    message with what Envoy expects, in order."""

    def __init__(self, director: Director) -> None:
        self.d = director
        # The EPP stream carries the response itself: nothing else releases it.
        self.ex = Exchange()
        self.request_id = ""
        self.generated_id = False
        self.rewrite_to = ""  # the model the client's name is rewritten to ("" none)
        self.client_model = ""
        self.hint: frozenset[str] | None = None
        self.routed = False  # the headers response has been sent
        # The request body's end was handed back: later request-body messages (Envoy >= 1.35
        # re-delivers the last chunk of a large body, GIE #2988, envoy #46237) are ignored.
        self.request_ended = False
        self.failed = False  # an ImmediateResponse ended the exchange
        self.body = bytearray()
        self.response_held = bytearray()  # a non-streamed answer that needs rewriting
        self.served: str | None = None
        flow = director.flow
        self.flow_headers = frozenset(header_names(flow.config)) if flow else frozenset()
        self.headers: dict[str, str] = {}  # what flow control reads

    # -- dispatch -----------------------------------------------------------------------------
    def handle(self, msg: ep.ProcessingRequest) -> Answers:
        """The answers to one message, in order; a :class:`Pending` (the servicer awaits
        it) when flow control holds the request."""
        if self.failed:
            return []
        kind = msg.WhichOneof("request")
        try:
            if kind == "request_headers":
                return self._request_headers(msg)
            if kind == "request_body":
                return self._request_body(msg.request_body.body, msg.request_body.end_of_stream)
            if kind == "request_trailers":  # the body ended without end_of_stream
                out = [] if self.routed else self._request_body(b"", False, last=True)
                trailers = ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
                if isinstance(out, Pending):
                    return self._after(out, [trailers])
                if self.failed:
                    return out
                return [*out, trailers]
            if kind == "response_headers":
                return self._response_headers(msg)
            if kind == "response_body":
                return self._response_body(msg.response_body.body,
                                           msg.response_body.end_of_stream)
            if kind == "response_trailers":
                out = self._flush_response(last=False)
                self.d.finish(self.ex)
                return [*out, ep.ProcessingResponse(response_trailers=ep.TrailersResponse())]
        except RequestError as err:  # reported to the lifecycle where it was raised
            return [self._fail(err)]
        return [self._fail(self.d.fail(self.ex, RequestError(
            400, f"unexpected ext_proc message {kind!r}")))]

    def ended(self) -> None:
        """The stream closed: the request is over, however it ended."""
        self.d.finish(self.ex, aborted=True)

    def _fail(self, err: RequestError) -> ep.ProcessingResponse:
        self.failed = True
        return immediate(err)

    # -- request ------------------------------------------------------------------------------
    def _request_headers(self, msg: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        hm = msg.request_headers
        if self.flow_headers:
            self.headers = some_headers(hm, self.flow_headers)
        for h in hm.headers.headers:
            key = h.key.lower()
            if key == REQUEST_ID_HEADER:
                self.request_id = header_value(h)
            elif key == MODEL_REWRITE_HEADER:
                self.rewrite_to = header_value(h).strip()
        if not self.request_id:  # the reference generates one (pkg/epp/handlers/server.go)
            self.request_id, self.generated_id = str(uuid.uuid4()), True
        self.hint = subset_hint(msg)
        method, path, length = request_line(hm)
        err = self.d.begin(self.ex, method, path, length, end_of_stream=hm.end_of_stream)
        if err is not None:
            raise err
        if self.ex.inference:
            return []  # answered once the body is complete
        # Not inference (or no body): any ready worker of the subset, at once.
        target = self.d.any_worker(self.ex, self._only())
        if target is None:
            raise self.d.fail(self.ex, RequestError(503, "no ready endpoint" + (
                " in the proxy's subset hint" if self.hint is not None else ""),
                code="no_healthy_worker", retry_after_s=1.0))
        self.routed = True
        return [self._headers_response(target)]

    def _only(self) -> frozenset[str] | None:
        if self.hint is None:
            return None
        workers = [a for pool in self.d.router.pools.values() for a in pool.workers]
        return allowed(workers, self.hint)

    def _headers_response(self, target: str, extra: dict[str, str] | None = None
                          ) -> ep.ProcessingResponse:
        """The destination as the header and as envoy.lb metadata, the same value in both
        (the protocol forbids them to differ)."""
        pairs = {DESTINATION_HEADER: target, **(extra or {})}
        if self.generated_id:
            pairs[REQUEST_ID_HEADER] = self.request_id
        remove = [MODEL_REWRITE_HEADER] if self.rewrite_to else []
        common = ep.CommonResponse(header_mutation=header_mutation(pairs, remove),
                                   clear_route_cache=True)
        return ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common),
                                     dynamic_metadata=lb_metadata(target))

    def _request_body(self, data: bytes, eos: bool, *, last: bool = False) -> Answers:
        if self.request_ended:  # a duplicate end-of-stream's body (GIE #2988): ignored
            return []
        self.request_ended = eos
        if self.routed:  # not inference: hand each chunk straight back
            return streamed_body(data, eos, response=False)
        self.body += data
        err = self.d.check_size(self.ex, len(self.body))
        if err is not None:
            raise err
        if not (eos or last):
            return []
        raw = self._rewritten(bytes(self.body))
        self.body = bytearray()
        routed = self.d.route(self.ex, raw, only=self._only(), headers=self.headers)
        self.routed = True

        def answers(decision: Decision) -> list[ep.ProcessingResponse]:
            # The body may have changed (model rewrite): the worker must get the right length.
            resp = self._headers_response(decision.chosen, {DECISION_HEADER: decision.id,
                                                            "content-length": str(len(raw))})
            return [resp, *streamed_body(raw, eos, response=False)]

        if isinstance(routed, Decision):
            return answers(routed)
        return Pending(self.d, self.ex, routed, answers, lambda err: [self._fail(err)])

    @staticmethod
    def _after(pending: Pending[ep.ProcessingResponse], more: list[ep.ProcessingResponse]
               ) -> Pending[ep.ProcessingResponse]:
        """``pending``'s answers, then ``more`` unless it failed."""
        then = pending.then
        pending.then = lambda d: [*then(d), *more]
        return pending

    def _rewritten(self, raw: bytes) -> bytes:
        """The body with ``model`` set to the rewrite header's value (the reference's
        ``x-gateway-model-name-rewrite``, pkg/epp/requestcontrol/director.go); as it came
        when there is none, or the body is not a JSON object with a string model (then the
        parser's 400 says why)."""
        if not self.rewrite_to:
            return raw
        try:
            doc = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return raw
        if not isinstance(doc, dict) or not isinstance(doc.get("model"), str):
            return raw
        self.client_model = doc["model"]
        doc["model"] = self.rewrite_to
        return orjson.dumps(doc)

    # -- response -----------------------------------------------------------------------------
    def _response_headers(self, msg: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        hm = msg.response_headers
        status = None
        for h in hm.headers.headers:
            if h.key == ":status":
                status = header_value(h)
            elif h.key == "content-type" and "text/event-stream" in header_value(h):
                self.ex.stream = True
        self.served = served_endpoint(msg)
        self.d.response_started(self.ex, status, self.served, None, hm.end_of_stream)
        pairs: dict[str, str] = {}
        if self.served:
            pairs[SERVED_REPORT_HEADER] = pairs[WORKER_HEADER] = self.served
        if self.ex.decision is not None:
            pairs[DECISION_HEADER] = self.ex.decision.id
        remove = []
        if self._holds_response():  # its length changes when the model is rewritten back
            remove.append("content-length")
        return [ep.ProcessingResponse(response_headers=ep.HeadersResponse(
            response=ep.CommonResponse(header_mutation=header_mutation(pairs, remove))))]

    def _holds_response(self) -> bool:
        return bool(self.client_model) and self.client_model != self.rewrite_to

    def _response_body(self, data: bytes, eos: bool) -> list[ep.ProcessingResponse]:
        self.d.response_chunk(self.ex, data, eos)
        if self._holds_response():
            if self.ex.stream:  # streamed: each chunk rewritten and passed on at once
                return streamed_body(_rewrite(data, self.rewrite_to, self.client_model), eos,
                                     response=True)
            self.response_held += data
            return self._flush_response(last=True) if eos else []
        return streamed_body(data, eos, response=True)

    def _flush_response(self, *, last: bool) -> list[ep.ProcessingResponse]:
        """A held (non-streamed) answer, rewritten, back to Envoy."""
        if not self.response_held and not last:
            return []
        held, self.response_held = bytes(self.response_held), bytearray()
        return streamed_body(_rewrite(held, self.rewrite_to, self.client_model), last,
                             response=True)

