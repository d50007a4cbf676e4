"""A minimal endpoint picker written only from the protocol text, as a test fixture: proof
that the conformance suite's protocol rules do not encode CachePilot's quirks.

Source, and nothing else: kubernetes-sigs/gateway-api-inference-extension
``docs/proposals/004-endpoint-picker-protocol/README.md`` @84436a96 (v1.0.0 of the protocol).
It implements the ext_proc service (L14-15) in streaming mode (L17); reads the subset hint as
the list the proposal shows (L32-40) and picks only from it (L42), from its pool without one
(L44); names its picks in the ``x-gateway-destination-endpoint`` header and, the same string,
in ``envoy.lb`` dynamic metadata (L50-82), the pick first and one more endpoint after it (the
proposal's ``<ip:port>,<ip:port>`` form, L73); answers 503 as an ImmediateResponse when the
list is empty, names nothing eligible, or no endpoint is ready (L42, L79); and serves the
gRPC health services (L105-115). Which endpoints are ready the proposal leaves open: this one
asks each endpoint's ``/health``. It picks at random, parses nothing, and hands every body
back unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
DESTINATION = "x-gateway-destination-endpoint"
HEALTH_SERVICES = ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")
CHUNK = 64 * 1024  # bodies are handed back in pieces of this size


class Refused(Exception):
    """The request is answered by the EPP itself (an ImmediateResponse)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status


class Stream:
    """One ext_proc stream (one HTTP exchange). Subclasses change one step at a time."""

    def __init__(self, epp: MinimalEpp) -> None:
        self.epp = epp
        self.hint: list[str] | None = None
        self.body = bytearray()
        self.routed = False

    # -- the subset hint and the pick ---------------------------------------------------------
    def read_hint(self, msg: ep.ProcessingRequest) -> list[str] | None:
        """The proposal's form: a list of ip:port strings (None: no hint)."""
        ns = msg.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
        if ns is None or SUBSET_KEY not in ns.fields:
            return None
        value = ns.fields[SUBSET_KEY]
        if value.WhichOneof("kind") != "list_value":
            return None
        return [v.string_value for v in value.list_value.values]

    def eligible(self) -> list[str]:
        ready = [e for e in self.epp.endpoints if e in self.epp.ready]
        if self.hint is None:
            return ready
        if not self.hint:
            raise self.refusal(503, "the subset hint is empty")
        return [e for e in ready if self.in_hint(e)]

    def in_hint(self, endpoint: str) -> bool:
        return endpoint in (self.hint or ())

    def pick(self) -> list[str]:
        candidates = self.eligible()
        if not candidates:
            raise self.refusal(503, "no ready endpoint" + (
                " in the subset hint" if self.hint is not None else ""))
        first = random.choice(candidates)
        rest = [c for c in candidates if c != first]
        return [first, *random.sample(rest, min(1, len(rest)))]

    def refusal(self, status: int, text: str) -> Refused:
        return Refused(status, text)

    def destination(self, picks: list[str]) -> tuple[str, str]:
        """(the header's value, the metadata's value): the same."""
        value = ",".join(picks)
        return value, value

    # -- answers ------------------------------------------------------------------------------
    def headers_response(self, picks: list[str]) -> ep.ProcessingResponse:
        header, meta = self.destination(picks)
        mutation = ep.HeaderMutation()
        if header:
            mutation.set_headers.append(base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=DESTINATION, raw_value=header.encode()),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD))
        self.extra_headers(mutation)
        metadata = struct_pb2.Struct()
        if meta:
            metadata.update({LB_NAMESPACE: {DESTINATION: meta}})
        return ep.ProcessingResponse(
            request_headers=ep.HeadersResponse(response=ep.CommonResponse(
                header_mutation=mutation, clear_route_cache=True)),
            dynamic_metadata=metadata)

    def extra_headers(self, mutation: ep.HeaderMutation) -> None:
        """More request headers to set (none here)."""

    def body_responses(self, data: bytes, eos: bool, *, response: bool
                       ) -> list[ep.ProcessingResponse]:
        pieces = [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)] or [b""]
        key = "response_body" if response else "request_body"
        return [ep.ProcessingResponse(**{key: ep.BodyResponse(response=ep.CommonResponse(
            body_mutation=ep.BodyMutation(streamed_response=ep.StreamedBodyResponse(
                body=p, end_of_stream=eos and i == len(pieces) - 1))))})
            for i, p in enumerate(pieces)]

    async def immediate(self, refused: Refused, context: Any) -> ep.ProcessingResponse:
        return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=refused.status), body=str(refused).encode()))

    # -- the exchange -------------------------------------------------------------------------
    def request_headers(self, msg: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        self.hint = self.read_hint(msg)
        if msg.request_headers.end_of_stream:  # no body: pick now
            return self.route(b"", eos=None)
        return []

    def request_body(self, data: bytes, eos: bool) -> list[ep.ProcessingResponse]:
        if self.routed:  # after the pick: handed straight back
            return self.body_responses(data, eos, response=False)
        self.body += data
        return self.route(bytes(self.body), eos=True) if eos else []

    def route(self, body: bytes, eos: bool | None) -> list[ep.ProcessingResponse]:
        body = self.prepare_body(body)
        picks = self.pick()
        self.routed = True
        out = [self.headers_response(picks)]
        if eos is not None:
            out += self.body_responses(body, eos, response=False)
        return out

    def prepare_body(self, body: bytes) -> bytes:
        """The body as it goes to the endpoint (unchanged here)."""
        return body

    def response_headers(self, msg: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        return [ep.ProcessingResponse(response_headers=ep.HeadersResponse())]

    def response_body(self, data: bytes, eos: bool) -> list[ep.ProcessingResponse]:
        return self.body_responses(data, eos, response=True)

    async def handle(self, msg: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        kind = msg.WhichOneof("request")
        if kind == "request_headers":
            return self.request_headers(msg)
        if kind == "request_body":
            return self.request_body(msg.request_body.body, msg.request_body.end_of_stream)
        if kind == "request_trailers":
            out = [] if self.routed else self.route(bytes(self.body), eos=False)
            return [*out, ep.ProcessingResponse(request_trailers=ep.TrailersResponse())]
        if kind == "response_headers":
            return self.response_headers(msg)
        if kind == "response_body":
            return self.response_body(msg.response_body.body, msg.response_body.end_of_stream)
        return [ep.ProcessingResponse(response_trailers=ep.TrailersResponse())]


class MinimalEpp(ep_grpc.ExternalProcessorServicer):
    """The endpoint picker of one pool: ``endpoints`` are its ip:port (IPv6 as [addr]:port)."""

    stream_class: type[Stream] = Stream

    def __init__(self, endpoints: list[str], *, poll_s: float = 0.1) -> None:
        self.endpoints = list(endpoints)
        self.ready = set(self.endpoints)
        self.poll_s = poll_s
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._poller: asyncio.Task[None] | None = None

    async def Process(self, request_iterator: AsyncIterator[ep.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[ep.ProcessingResponse]:
        stream = self.stream_class(self)
        async for msg in request_iterator:
            try:
                out = await stream.handle(msg)
            except Refused as refused:
                yield await stream.immediate(refused, context)
                return
            for resp in out:
                yield resp

    async def health_services(self, servicer: health.aio.HealthServicer) -> None:
        for name in HEALTH_SERVICES:
            await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def start(self, host: str = "127.0.0.1") -> int:
        self._server = grpc.aio.server()
        ep_grpc.add_ExternalProcessorServicer_to_server(self, self._server)
        servicer = health.aio.HealthServicer()
        await self.health_services(servicer)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, self._server)
        self.port = self._server.add_insecure_port(f"{host}:0")
        await self._server.start()
        self._poller = asyncio.create_task(self._poll())
        return self.port

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self._server is not None:
            await self._server.stop(0)

    async def _poll(self) -> None:
        """Which endpoints are ready: their /health answers 200."""
        timeout = aiohttp.ClientTimeout(total=1)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                for e in self.endpoints:
                    await self.probe(session, e)
                await asyncio.sleep(self.poll_s)

    async def probe(self, session: aiohttp.ClientSession, endpoint: str) -> None:
        try:
            async with session.get(f"http://{endpoint}/health") as r:
                ok = r.status == 200
        except (TimeoutError, aiohttp.ClientError):
            ok = False
        (self.ready.add if ok else self.ready.discard)(endpoint)
