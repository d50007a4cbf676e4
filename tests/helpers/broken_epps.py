"""Mutation testing of the conformance suite: :class:`CompleteEpp` (the independent EPP plus
the reference EPP's recommended behaviour) passes every rule of the EPP-Core profile, and
each broken EPP below is it with one defect. ``EXPECTED`` says which rules each must fail."""

from __future__ import annotations

import uuid
from typing import Any

import aiohttp
import grpc
import orjson
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from grpc_health.v1 import health_pb2

from helpers.independent_epp import (
    HEALTH_SERVICES,
    LB_NAMESPACE,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
    MinimalEpp,
    Refused,
    Stream,
)

SERVED = "x-gateway-destination-endpoint-served"
SERVED_ECHO = "x-conformance-test-served-endpoint"
REWRITE = "x-gateway-model-name-rewrite"
_SET = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def _set(mutation: ep.HeaderMutation, key: str, value: str) -> None:
    mutation.set_headers.append(base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=_SET))


def _rewrite(data: bytes, old: str, new: str) -> bytes:
    for sep in (b":", b": "):
        data = data.replace(b'"model"' + sep + orjson.dumps(old),
                            b'"model"' + sep + orjson.dumps(new))
    return data


class CompleteStream(Stream):
    """The reference EPP's recommended behaviour on top of the protocol: the string form of
    the hint, 400 for a body it cannot parse, x-request-id kept or generated, the model name
    rewrite, the served endpoint echoed, a duplicate end-of-stream ignored."""

    def __init__(self, epp: MinimalEpp) -> None:
        super().__init__(epp)
        self.request_id = ""
        self.rewrite_to = ""
        self.client_model = ""
        self.body_len: int | None = None
        self.ended = False
        self.sse = False
        self.held = bytearray()

    def read_hint(self, msg: ep.ProcessingRequest) -> list[str] | None:
        ns = msg.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
        if ns is None or SUBSET_KEY not in ns.fields:
            return None
        value = ns.fields[SUBSET_KEY]
        if value.WhichOneof("kind") == "string_value":
            return [p.strip() for p in value.string_value.split(",") if p.strip()]
        return super().read_hint(msg)

    def request_headers(self, msg: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        headers = {h.key: h.raw_value.decode("latin-1") or h.value
                   for h in msg.request_headers.headers.headers}
        self.request_id = headers.get("x-request-id", "") or self.new_request_id()
        self.rewrite_to = headers.get(REWRITE, "")
        return super().request_headers(msg)

    def new_request_id(self) -> str:
        return str(uuid.uuid4())

    def extra_headers(self, mutation: ep.HeaderMutation) -> None:
        if self.request_id:
            _set(mutation, "x-request-id", self.request_id)
        if self.body_len is not None:
            _set(mutation, "content-length", str(self.body_len))
        if self.rewrite_to:
            mutation.remove_headers.append(REWRITE)

    def prepare_body(self, body: bytes) -> bytes:
        if not body:
            return body
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise self.refusal(400, f"cannot parse the body: {exc}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("model"), str):
            raise self.refusal(400, "no model in the body")
        if self.rewrite_to:
            self.client_model, doc["model"] = doc["model"], self.rewrite_to
            body = orjson.dumps(doc)
        self.body_len = len(body)
        return body

    def request_body(self, data: bytes, eos: bool) -> list[ep.ProcessingResponse]:
        if self.ended:  # a duplicate end-of-stream (GIE #2988)
            return []
        self.ended = eos
        return super().request_body(data, eos)

    def response_headers(self, msg: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        mutation = ep.HeaderMutation()
        ns = msg.metadata_context.filter_metadata.get(LB_NAMESPACE)
        served = ns.fields.get(SERVED) if ns is not None else None
        _set(mutation, SERVED_ECHO, self.served_echo(served.string_value if served else ""))
        for h in msg.response_headers.headers.headers:
            if h.key == "content-type" and b"event-stream" in (h.raw_value or h.value.encode()):
                self.sse = True
        if self.client_model and not self.sse:
            mutation.remove_headers.append("content-length")
        return [ep.ProcessingResponse(response_headers=ep.HeadersResponse(
            response=ep.CommonResponse(header_mutation=mutation)))]

    def served_echo(self, reported: str) -> str:
        return reported

    def response_body(self, data: bytes, eos: bool) -> list[ep.ProcessingResponse]:
        if not self.client_model:
            return super().response_body(data, eos)
        if self.sse:
            return super().response_body(_rewrite(data, self.rewrite_to, self.client_model), eos)
        self.held += data
        if not eos:
            return []
        return super().response_body(_rewrite(bytes(self.held), self.rewrite_to,
                                              self.client_model), True)


class CompleteEpp(MinimalEpp):
    stream_class = CompleteStream


# -- one defect each ---------------------------------------------------------------------------
class HeaderMetadataDiffer(CompleteStream):
    """The metadata's second endpoint is not the header's."""

    def destination(self, picks: list[str]) -> tuple[str, str]:
        header, meta = super().destination(picks)
        others = [e for e in self.epp.endpoints if e not in picks]
        if len(picks) > 1 and others:
            meta = ",".join([picks[0], others[0]])
        return header, meta


class NoMetadata(CompleteStream):
    def destination(self, picks: list[str]) -> tuple[str, str]:
        return super().destination(picks)[0], ""


class NoHeader(CompleteStream):
    def destination(self, picks: list[str]) -> tuple[str, str]:
        return "", super().destination(picks)[1]


class Ipv6Unbracketed(CompleteStream):
    """Writes [::1]:8000 as ::1:8000."""

    def destination(self, picks: list[str]) -> tuple[str, str]:
        value = ",".join(p.replace("[", "").replace("]", "") for p in picks)
        return value, value


class Ipv6SubsetUnmatched(CompleteStream):
    """Compares hint entries with its endpoints written ip:port without brackets, so the
    hint's [::1]:8000 never matches (what ai-dynamo/dynamo#12064 fixed; the full reference
    EPP's candidates.go has the like: "[::1]" never equals the pod IP "::1")."""

    def in_hint(self, endpoint: str) -> bool:
        return endpoint.replace("[", "").replace("]", "") in (self.hint or ())


class SubsetStringOnly(CompleteStream):
    """Reads the hint only as a string (the protocol's list is ignored)."""

    def read_hint(self, msg: ep.ProcessingRequest) -> list[str] | None:
        ns = msg.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
        v = ns.fields.get(SUBSET_KEY) if ns is not None else None
        if v is None or v.WhichOneof("kind") != "string_value":
            return None
        return [p.strip() for p in v.string_value.split(",") if p.strip()]


class SubsetListOnly(CompleteStream):
    """Reads the hint only as the protocol's list (a string is ignored)."""

    def read_hint(self, msg: ep.ProcessingRequest) -> list[str] | None:
        return Stream.read_hint(self, msg)


class EmptyListIsNoHint(CompleteStream):
    def read_hint(self, msg: ep.ProcessingRequest) -> list[str] | None:
        return super().read_hint(msg) or None


class StreamError503(CompleteStream):
    """Ends the stream with a gRPC error where a 503 ImmediateResponse is due (as the
    lightweight reference EPP does)."""

    async def immediate(self, refused: Refused, context: Any) -> ep.ProcessingResponse:
        if refused.status == 503:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(refused))
        return await super().immediate(refused, context)


class BodylessIgnoresSubset(CompleteStream):
    """A request without a body goes to any endpoint (the full reference EPP's request.go)."""

    def request_headers(self, msg: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        if msg.request_headers.end_of_stream:
            msg = ep.ProcessingRequest(request_headers=msg.request_headers)
        return super().request_headers(msg)


class BodyCutAt2MB(CompleteStream):
    def prepare_body(self, body: bytes) -> bytes:
        return super().prepare_body(body)[:2 * 1024 * 1024]


class Utf8PerChunk(CompleteStream):
    """Decodes each body chunk as UTF-8 on its own (a character split across two chunks is
    replaced)."""

    def request_body(self, data: bytes, eos: bool) -> list[ep.ProcessingResponse]:
        return super().request_body(data.decode("utf-8", "replace").encode(), eos)


class ResponseBuffered(CompleteStream):
    """Holds every answer until its end."""

    def response_body(self, data: bytes, eos: bool) -> list[ep.ProcessingResponse]:
        self.buffered = getattr(self, "buffered", b"") + data
        return super().response_body(self.buffered, True) if eos else []


class DuplicateEosReparsed(CompleteStream):
    """Appends a chunk that comes after the end and parses again (GIE #2988's BBR)."""

    def request_body(self, data: bytes, eos: bool) -> list[ep.ProcessingResponse]:
        if self.ended:
            self.body += data
            self.prepare_body(bytes(self.body))
            return []
        return super().request_body(data, eos)


class NoRequestIdGenerated(CompleteStream):
    def new_request_id(self) -> str:
        return ""


class RequestIdReplaced(CompleteStream):
    """Sets a new x-request-id even when the client sent one."""

    def request_headers(self, msg: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        msg = ep.ProcessingRequest(request_headers=msg.request_headers,
                                   metadata_context=msg.metadata_context)
        kept = [h for h in msg.request_headers.headers.headers if h.key != "x-request-id"]
        del msg.request_headers.headers.headers[:]
        msg.request_headers.headers.headers.extend(kept)
        return super().request_headers(msg)


class NoRewrite(CompleteStream):
    def request_headers(self, msg: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        out = super().request_headers(msg)
        self.rewrite_to = ""
        return out


class BadBodyRouted(CompleteStream):
    def prepare_body(self, body: bytes) -> bytes:
        try:
            return super().prepare_body(body)
        except Refused:
            return body


class ServedEchoesPick(CompleteStream):
    def route(self, body: bytes, eos: bool | None) -> list[ep.ProcessingResponse]:
        out = super().route(body, eos)
        header, meta = _destination(out[0])
        self.first_pick = (header or meta).split(",")[0]
        return out

    def served_echo(self, reported: str) -> str:
        return getattr(self, "first_pick", reported)


def _destination(resp: ep.ProcessingResponse) -> tuple[str, str]:
    header = next((h.header.raw_value.decode() for h in
                   resp.request_headers.response.header_mutation.set_headers
                   if h.header.key == "x-gateway-destination-endpoint"), "")
    ns = resp.dynamic_metadata.fields.get(LB_NAMESPACE)
    meta = ""
    if ns is not None:
        meta = ns.struct_value.fields["x-gateway-destination-endpoint"].string_value
    return header, meta


class NamesOutsidePool(CompleteStream):
    """Without a hint, adds a stale endpoint (not in its pool) after its pick."""

    def pick(self) -> list[str]:
        picks = super().pick()
        return picks if self.hint is not None else [*picks, "127.0.0.1:1"]


class NoLivenessEpp(CompleteEpp):
    async def health_services(self, servicer: Any) -> None:
        for name in HEALTH_SERVICES:
            if name != "liveness":
                await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


class Sheds503Stream(CompleteStream):
    """Drops requests to a saturated pool with 503 rather than 429."""

    def eligible(self) -> list[str]:
        found = super().eligible()
        if found and all(e in self.epp.saturated for e in found):
            raise self.refusal(503, "saturated")
        return found


class Sheds503Epp(CompleteEpp):
    stream_class = Sheds503Stream

    def __init__(self, endpoints: list[str], **kw: Any) -> None:
        super().__init__(endpoints, **kw)
        self.saturated: set[str] = set()

    async def probe(self, session: aiohttp.ClientSession, endpoint: str) -> None:
        await super().probe(session, endpoint)
        try:
            async with session.get(f"http://{endpoint}/metrics") as r:
                text = await r.text()
        except aiohttp.ClientError:
            return
        waiting = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:num_requests_waiting")]
        (self.saturated.add if waiting and waiting[0] > 1000 else self.saturated.discard)(
            endpoint)


def _epp(stream: type[CompleteStream]) -> type[CompleteEpp]:
    return type(stream.__name__ + "Epp", (CompleteEpp,), {"stream_class": stream})


# The broken EPPs, and the rules each must fail (and no other).
BROKEN: dict[str, tuple[type[MinimalEpp], set[str]]] = {
    "header-metadata-differ": (_epp(HeaderMetadataDiffer), {"P02"}),
    "no-metadata": (_epp(NoMetadata), {"P02"}),
    "no-header": (_epp(NoHeader), {"P01"}),
    "ipv6-unbracketed": (_epp(Ipv6Unbracketed), {"P03"}),
    "ipv6-subset-unmatched": (_epp(Ipv6SubsetUnmatched), {"P03"}),
    "subset-string-only": (_epp(SubsetStringOnly),
                           {"P03", "P05", "P06", "P07", "P08", "P16"}),
    "subset-list-only": (_epp(SubsetListOnly), {"R07"}),
    "empty-list-is-no-hint": (_epp(EmptyListIsNoHint), {"P06"}),
    "stream-error-not-503": (_epp(StreamError503),
                             {"P06", "P07", "P08", "P09", "P15", "P16", "R07"}),
    "bodyless-ignores-subset": (_epp(BodylessIgnoresSubset), {"P08", "P16"}),
    "names-outside-pool": (_epp(NamesOutsidePool), {"P04", "P15"}),
    "body-cut-at-2mb": (_epp(BodyCutAt2MB), {"P11"}),
    "utf8-per-chunk": (_epp(Utf8PerChunk), {"P12"}),
    "response-buffered": (_epp(ResponseBuffered), {"P13"}),
    "no-liveness": (NoLivenessEpp, {"P14"}),
    "sheds-with-503": (Sheds503Epp, {"P10"}),
    "bad-body-routed": (_epp(BadBodyRouted), {"R01"}),
    "request-id-replaced": (_epp(RequestIdReplaced), {"R02"}),
    "no-request-id": (_epp(NoRequestIdGenerated), {"R03"}),
    "no-rewrite": (_epp(NoRewrite), {"R04"}),
    "served-echoes-pick": (_epp(ServedEchoesPick), {"R05"}),
    "duplicate-eos-reparsed": (_epp(DuplicateEosReparsed), {"R06"}),
}

