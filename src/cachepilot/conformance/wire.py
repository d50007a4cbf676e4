"""A direct ext_proc client playing Envoy, for the cases Envoy cannot produce on demand: a
body split at a chosen byte, a duplicate end-of-stream chunk (GIE #2988), a served-endpoint
report that differs from the pick. Still black box: it knows only the EPP's address, and
sends what Envoy configured as the reference gateway sends (headers SEND, bodies
FULL_DUPLEX_STREAMED, the hint in ``metadata_context``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2

from cachepilot.gateway.protocol import (
    DESTINATION_HEADER,
    LB_METADATA_NAMESPACE,
    SERVED_KEY,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
)

_DUPLEX = pm.ProcessingMode.FULL_DUPLEX_STREAMED


def _headers(pairs: dict[str, str]) -> ep.HttpHeaders:
    return ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]))


def request_headers(*, method: str = "POST", path: str = "/v1/completions",
                    headers: dict[str, str] | None = None, end_of_stream: bool = False,
                    hint: Sequence[str] | None = None) -> ep.ProcessingRequest:
    pairs = {":method": method, ":path": path, ":scheme": "http",
             ":authority": "conformance", **({"content-type": "application/json"}
                                             if method == "POST" else {}),
             **(headers or {})}
    msg = ep.ProcessingRequest(request_headers=_headers(pairs),
                               protocol_config=ep.ProtocolConfiguration(
                                   request_body_mode=_DUPLEX, response_body_mode=_DUPLEX))
    msg.request_headers.end_of_stream = end_of_stream
    if hint is not None:
        md = struct_pb2.Struct()
        md.update({SUBSET_KEY: list(hint)})
        msg.metadata_context.filter_metadata[SUBSET_NAMESPACE].CopyFrom(md)
    return msg


def request_body(data: bytes, end_of_stream: bool) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=data,
                                                         end_of_stream=end_of_stream))


def response_headers(status: int = 200, served: str | None = None,
                     content_type: str = "application/json") -> ep.ProcessingRequest:
    msg = ep.ProcessingRequest(response_headers=_headers(
        {":status": str(status), "content-type": content_type}))
    if served is not None:
        md = struct_pb2.Struct()
        md.update({SERVED_KEY: served})
        msg.metadata_context.filter_metadata[LB_METADATA_NAMESPACE].CopyFrom(md)
    return msg


def response_body(data: bytes, end_of_stream: bool) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(response_body=ep.HttpBody(body=data,
                                                          end_of_stream=end_of_stream))


@dataclass
class Exchange:
    """What the EPP answered on one stream."""

    responses: list[ep.ProcessingResponse] = field(default_factory=list)
    error: str = ""  # the stream ended with a gRPC error

    def of(self, kind: str) -> list[ep.ProcessingResponse]:
        return [r for r in self.responses if r.WhichOneof("response") == kind]

    @property
    def immediate(self) -> ep.ImmediateResponse | None:
        found = self.of("immediate_response")
        return found[0].immediate_response if found else None

    def destination(self) -> tuple[str | None, str | None]:
        """(header, metadata) of the first request-headers answer."""
        answers = self.of("request_headers")
        if not answers:
            return None, None
        first = answers[0]
        header = next((h.header.raw_value.decode() or h.header.value for h in
                       first.request_headers.response.header_mutation.set_headers
                       if h.header.key.lower() == DESTINATION_HEADER), None)
        ns = first.dynamic_metadata.fields.get(LB_METADATA_NAMESPACE)
        meta = None
        if ns is not None and ns.WhichOneof("kind") == "struct_value":
            v = ns.struct_value.fields.get(DESTINATION_HEADER)
            meta = v.string_value if v is not None else None
        return header, meta

    def body(self, *, response: bool = False, to_end: bool = True) -> tuple[bytes, bool]:
        """The body handed back (request or response), up to its end_of_stream (all of it
        with ``to_end`` false); and whether the end was handed back."""
        key = "response_body" if response else "request_body"
        out = bytearray()
        for r in self.of(key):
            s = getattr(r, key).response.body_mutation.streamed_response
            out += s.body
            if s.end_of_stream and to_end:
                return bytes(out), True
        return bytes(out), False

    def set_headers(self, kind: str) -> dict[str, str]:
        """The headers a headers answer of ``kind`` sets (the last such answer)."""
        found = self.of(kind)
        if not found:
            return {}
        mutation = getattr(found[-1], kind).response.header_mutation
        return {h.header.key.lower(): h.header.raw_value.decode() or h.header.value
                for h in mutation.set_headers}


Messages = Sequence[ep.ProcessingRequest] | Callable[[Exchange], Sequence[ep.ProcessingRequest]]


def request_done(ex: Exchange) -> bool:
    """The request phase is answered: refused, or the body handed back to its end (or, for
    a request without a body, the headers answered)."""
    if ex.immediate is not None or ex.error:
        return True
    return ex.body()[1]


class Wire:
    """One gRPC channel to the EPP."""

    def __init__(self, epp: tuple[str, int], timeout_s: float = 10.0) -> None:
        host = f"[{epp[0]}]" if ":" in epp[0] else epp[0]
        self.channel = grpc.aio.insecure_channel(f"{host}:{epp[1]}")
        self.stub = ep_grpc.ExternalProcessorStub(self.channel)
        self.timeout_s = timeout_s

    async def close(self) -> None:
        await self.channel.close()

    async def exchange(self, first: Sequence[ep.ProcessingRequest],
                       *later: tuple[Messages, str | None],
                       bodyless: bool = False, quiet_s: float = 0.3) -> Exchange:
        """Send ``first`` and read until the request is answered; then each of ``later``:
        its messages (or what a function of the exchange so far returns), and read until an
        answer of its kind arrives (None: until the EPP stays quiet for ``quiet_s``)."""
        ex = Exchange()
        call = self.stub.Process(timeout=self.timeout_s)
        try:
            for msg in first:
                await call.write(msg)
            await self._read(call, ex, (lambda e: bool(e.of("request_headers"))
                                        or request_done(e)) if bodyless else request_done,
                             self.timeout_s)
            for msgs, kind in later:
                if ex.immediate is not None or ex.error:
                    break
                for msg in (msgs(ex) if callable(msgs) else msgs):
                    await call.write(msg)
                if kind is None:
                    await self._read(call, ex, lambda e: False, quiet_s)
                else:
                    n = len(ex.of(kind))
                    await self._read(call, ex, lambda e, k=kind, n=n: len(e.of(k)) > n
                                     or e.immediate is not None, self.timeout_s)
        finally:
            call.cancel()
        return ex

    @staticmethod
    async def _read(call: grpc.aio.StreamStreamCall, ex: Exchange,
                    done: Callable[[Exchange], bool], wait_s: float) -> None:
        while not done(ex):
            try:
                async with asyncio.timeout(wait_s):
                    msg = await call.read()
            except TimeoutError:
                return
            except grpc.aio.AioRpcError as err:
                ex.error = f"{err.code().name}: {err.details()}"
                return
            if msg is grpc.aio.EOF:
                return
            ex.responses.append(msg)
