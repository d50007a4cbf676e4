"""Names and message builders shared by both ext_proc protocols the gateway speaks: its own
(Envoy configured by :mod:`cachepilot.deploy.envoy`) and the Gateway API Inference
Extension's endpoint picker protocol (:mod:`cachepilot.gateway.epp`; docs/epp.md)."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from cachepilot.core.decision import Decision
from cachepilot.core.flow.info import SHED_HEADER
from cachepilot.core.flow.refusal import FlowError
from cachepilot.core.request import RequestError

# -- the endpoint picker protocol (docs/proposals/004-endpoint-picker-protocol) -------------
DESTINATION_HEADER = "x-gateway-destination-endpoint"
# Where the destination also goes: dynamic metadata envoy.lb/<DESTINATION_HEADER>.
LB_METADATA_NAMESPACE = "envoy.lb"
# The proxy's subset hint: filter metadata envoy.lb.subset_hint/<SUBSET_KEY>, a list of
# ip:port (or a comma-separated string, as a header-to-metadata rule writes it).
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
# Who served the response: filter metadata envoy.lb/<SERVED_KEY> on the response messages.
SERVED_KEY = "x-gateway-destination-endpoint-served"
# The reference EPP's request headers (pkg/epp/metadata/consts.go).
MODEL_REWRITE_HEADER = "x-gateway-model-name-rewrite"
REQUEST_ID_HEADER = "x-request-id"
# The reference lightweight EPP echoes the served endpoint in this response header for the
# upstream conformance tests (pkg/lwepp/metadata/consts.go); so do we.
SERVED_REPORT_HEADER = "x-conformance-test-served-endpoint"
# Largest streamed body chunk sent back to Envoy (pkg/common/envoy/chunking.go: 62,000 bytes,
# under the 64 KiB some proxies allow per chunk).
BODY_CHUNK_LIMIT = 62_000

# -- CachePilot's own Envoy config ---------------------------------------------------------
DECISION_HEADER = "x-cachepilot-decision-id"
# Set by Envoy on every answer to the worker that answered (%UPSTREAM_HOST%).
WORKER_HEADER = "x-cachepilot-worker"
# Set by Envoy on its own replies that say why (e.g. worker_unreachable).
ERROR_HEADER = "x-cachepilot-error"
FALLBACKS = 2  # runner-ups after the chosen worker in the list Envoy's retries walk
# gRPC metadata Envoy's per-route ext_proc config adds to a stream: an observing stream's
# role, and a routing stream whose body comes BUFFERED (one message, after the headers'
# answer) rather than STREAMED. Any x-cachepilot-* key marks a stream as ours (not EPP).
METADATA_PREFIX = "x-cachepilot-"
ROLE_METADATA = "x-cachepilot-role"
OBSERVE_ROLE = "observe"
ROUTE_ROLE = "route"
BODY_METADATA = "x-cachepilot-body"
BUFFERED_BODY = "buffered"
# The routing stream gets no headers message: its first and only message is the whole body
# (Envoy's per-route config names the inference path in PATH_METADATA instead), and the
# answer routes through envoy.lb metadata alone (a body answer cannot change headers that
# were not sent). One message each way.
BODY_ONLY = "only"
PATH_METADATA = "x-cachepilot-path"
# envoy.lb metadata the body-only answer adds beside the destination list: the decision id
# (for the observing stream and the response header) and the chosen worker alone (what an
# ORIGINAL_DST cluster can read: one ip:port, not a list).
DECISION_KEY = DECISION_HEADER
CHOSEN_KEY = "x-cachepilot-chosen"
# Decision ids of gateway process i (``cachepilot gateway --processes N``) start
# "p<i>."; Envoy's per-process routes match on it to send the observing stream there.
PROCESS_ID_PREFIX = "p"
# How the routing stream's request will be observed, as Envoy's config says: "async" (an
# observing stream takes it over), "sync" (the routing stream carries the response), "off".
OBSERVE_METADATA = "x-cachepilot-observe"
# A fourth value, on both streams: the observing stream ends (the gateway closes it) at the
# first token, and Envoy's access log stream reports the response's end, status and usage
# (``AccessLogServicer`` in ``cachepilot.gateway.service``): a handful of messages however
# long the answer.
FIRST_TOKEN = "first-token"
# envoy.lb metadata the routing answer adds (value "1") to a request observed until the
# first token that is not streamed: its first byte is its end, which the access log reports
# with Envoy's timings, so Envoy's route for it disables the observing filter (no stream).
UNOBSERVED_KEY = "x-cachepilot-unobserved"
# Dynamic metadata namespace where Envoy's Lua filter (cachepilot.deploy.envoy.usage) puts
# the usage it read from the response's end; the access log entry carries it.
USAGE_NAMESPACE = "cachepilot.usage"

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def header_mutation(pairs: dict[str, str], remove: Iterable[str] = ()) -> ep.HeaderMutation:
    return ep.HeaderMutation(set_headers=[
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
                                   append_action=_OVERWRITE)
        for k, v in pairs.items()], remove_headers=list(remove))


def header_value(h: base_pb2.HeaderValue) -> str:
    """Envoy fills raw_value; value only in older versions."""
    return h.raw_value.decode("latin-1") if h.raw_value else h.value


# Where Envoy puts the request attributes it was asked to forward (ext_proc's
# request_attributes): the routing stream's first message carries them, a body-only one too.
ATTRIBUTES_KEY = "envoy.filters.http.ext_proc"
_HEADER_ATTR = "request.headers['"


def header_attribute(name: str) -> str:
    """The CEL attribute that forwards request header ``name`` (lower case)."""
    return f"{_HEADER_ATTR}{name}']"


def attribute_headers(msg: ep.ProcessingRequest) -> dict[str, str]:
    """The request headers Envoy forwarded as attributes (absent headers are not sent)."""
    attrs = msg.attributes.get(ATTRIBUTES_KEY)
    if attrs is None:
        return {}
    out = {}
    for key, value in attrs.fields.items():
        if key.startswith(_HEADER_ATTR) and value.WhichOneof("kind") == "string_value":
            out[key[len(_HEADER_ATTR):-2]] = value.string_value
    return out


def some_headers(msg: ep.HttpHeaders, names: Collection[str]) -> dict[str, str]:
    """The headers of a headers message whose (lower-case) names are in ``names``."""
    return {k: header_value(h) for h in msg.headers.headers
            if (k := h.key.lower()) in names}


def request_line(msg: ep.HttpHeaders) -> tuple[str, str, str | None]:
    """(method, path, content-length or None) of a request's headers message."""
    method = path = ""
    length = None
    for h in msg.headers.headers:
        if h.key == ":path":
            path = header_value(h)
        elif h.key == ":method":
            method = header_value(h)
        elif h.key == "content-length":
            length = header_value(h)
    return method, path, length


def fallback_list(d: Decision) -> str:
    """The chosen worker, then up to FALLBACKS eligible runner-ups, best first."""
    rest = sorted((c for c in d.candidates if c.eligible and c.worker != d.chosen),
                  key=lambda c: -c.value)
    return ",".join([d.chosen, *(c.worker for c in rest[:FALLBACKS])])


def lb_metadata(destinations: str, **more: str) -> struct_pb2.Struct:
    """envoy.lb metadata: the destination list, and ``more`` keys beside it."""
    md = struct_pb2.Struct()
    md.update({LB_METADATA_NAMESPACE: {DESTINATION_HEADER: destinations, **more}})
    return md


def lb_value(msg: ep.ProcessingRequest, key: str) -> str | None:
    """A string Envoy forwarded in the message's envoy.lb metadata, if there."""
    ns = msg.metadata_context.filter_metadata.get(LB_METADATA_NAMESPACE)
    if ns is None:
        return None
    v = ns.fields.get(key)
    return v.string_value if v is not None and v.HasField("string_value") else None


def immediate(err: RequestError) -> ep.ProcessingResponse:
    """A JSON error straight back to the client; Envoy never contacts a worker. A refusal
    by flow control says why in x-cachepilot-shed-reason."""
    hdrs = {"content-type": "application/json"}
    if err.retry_after_s is not None:
        hdrs["retry-after"] = str(int(err.retry_after_s))
    if isinstance(err, FlowError):
        hdrs[SHED_HEADER] = err.reason
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=err.status), headers=header_mutation(hdrs),
        body=err.to_json(), details=f"cachepilot_{err.code}"))


def streamed_body(data: bytes, end_of_stream: bool, *, response: bool
                  ) -> list[ep.ProcessingResponse]:
    """A body handed back to Envoy in FULL_DUPLEX_STREAMED mode, in chunks of at most
    BODY_CHUNK_LIMIT bytes, the last one carrying ``end_of_stream`` (one empty chunk when
    there is no data)."""
    key = "response_body" if response else "request_body"
    pieces = [data[i:i + BODY_CHUNK_LIMIT] for i in range(0, len(data), BODY_CHUNK_LIMIT)]
    pieces = pieces or [b""]
    return [ep.ProcessingResponse(**{key: ep.BodyResponse(response=ep.CommonResponse(
        body_mutation=ep.BodyMutation(streamed_response=ep.StreamedBodyResponse(
            body=p, end_of_stream=end_of_stream and i == len(pieces) - 1))))})
        for i, p in enumerate(pieces)]
