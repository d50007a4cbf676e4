"""Envoy's ExternalProcessor service: each stream goes to the protocol it speaks.

CachePilot's own Envoy config (:mod:`cachepilot.gateway.envoy_streams`) opens routing and
observing streams, told apart by the gRPC metadata its per-route config adds
(``x-cachepilot-role: observe`` on an observing stream; ``x-cachepilot-body``,
``x-cachepilot-path`` and ``x-cachepilot-observe`` say how a routing stream flows). Any other
gateway speaks the endpoint picker protocol (:mod:`cachepilot.gateway.epp`). With
``GatewayOptions.protocol`` "auto" a stream whose metadata has an ``x-cachepilot-*`` key is
ours (our generated config puts one on every stream), any other one EPP. Both are adapters
over one :class:`~cachepilot.gateway.director.Director`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
from envoy.service.accesslog.v3 import als_pb2 as als
from envoy.service.accesslog.v3 import als_pb2_grpc as als_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from cachepilot.core.request import RequestError
from cachepilot.gateway.director import Director, Exchange, Pending
from cachepilot.gateway.envoy_streams import EnvoyStreams, RoutingStream
from cachepilot.gateway.epp import EppStream
from cachepilot.gateway.protocol import (
    BODY_METADATA,
    BODY_ONLY,
    BUFFERED_BODY,
    FIRST_TOKEN,
    METADATA_PREFIX,
    OBSERVE_METADATA,
    OBSERVE_ROLE,
    PATH_METADATA,
    ROLE_METADATA,
    immediate,
)

log = logging.getLogger("cachepilot.gateway")

PROTOCOLS = ("auto", "cachepilot", "epp")


def _stream_kind(context: grpc.aio.ServicerContext | None) -> tuple[str, bool, RoutingStream]:
    """(role, ours, the routing stream's settings) from the metadata Envoy's per-route
    config adds to a stream; ``ours``: it has an x-cachepilot-* key."""
    role, ours, s = "", False, RoutingStream()
    if context is not None:
        for key, value in context.invocation_metadata() or ():
            if key.startswith(METADATA_PREFIX):
                ours = True
            if key == ROLE_METADATA:
                role = value
            elif key == BODY_METADATA:
                s.buffered = value == BUFFERED_BODY
                s.body_only = value == BODY_ONLY
            elif key == OBSERVE_METADATA:
                s.observe = value
            elif key == PATH_METADATA:
                s.ex.path = value
    return role, ours, s


def _internal_error(director: Director, ex: Exchange | None) -> ep.ProcessingResponse:
    """A bug must cost one request, not the gateway: a 500, reported like any error."""
    return immediate(director.fail(ex, RequestError(500, "internal routing error",
                                                    code="internal_error")))


class ExtProcServicer(ep_grpc.ExternalProcessorServicer):
    """grpc.aio adapter: one stream object per gRPC stream; never lets an exception kill the
    server."""

    def __init__(self, director: Director) -> None:
        self.director = director
        self.streams = EnvoyStreams(director)

    def _epp(self, ours: bool) -> bool:
        protocol = self.director.options.protocol
        return protocol == "epp" or (protocol == "auto" and not ours)

    async def Process(self, request_iterator: AsyncIterator[ep.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[ep.ProcessingResponse]:
        role, ours, s = _stream_kind(context)
        if self._epp(ours):
            async for resp in self._epp_stream(request_iterator):
                yield resp
            return
        if role == OBSERVE_ROLE:
            await self._observe(request_iterator, until_first_token=s.observe == FIRST_TOKEN)
            return
        # A body-only stream whose response goes elsewhere (an observing stream, or nowhere)
        # is done once its one message is answered: end it then, rather than wake again for
        # Envoy's close at the request's end (Envoy ignores a stream its server closed);
        # unless Envoy's access log will end the request: that close bounds the wait for it.
        done_after_answer = s.body_only and s.observe != "sync"
        try:
            async for msg in request_iterator:
                try:
                    out = self.streams.handle(s, msg)
                    if isinstance(out, Pending):  # held by flow control: the stream waits
                        out = await out.answers()
                    for resp in out:
                        yield resp
                except RequestError as err:
                    yield immediate(self.director.fail(s.ex, err))
                except Exception:
                    log.exception("ext_proc message failed")
                    yield _internal_error(self.director, s.ex)
                if done_after_answer and not self.streams.awaits_end(s):
                    return
        finally:
            self.streams.routing_ended(s)

    async def _epp_stream(self, request_iterator: AsyncIterator[ep.ProcessingRequest]
                          ) -> AsyncIterator[ep.ProcessingResponse]:
        stream = EppStream(self.director)
        try:
            async for msg in request_iterator:
                try:
                    out = stream.handle(msg)
                    if isinstance(out, Pending):  # held by flow control: the stream waits
                        out = await out.answers()
                except Exception:
                    log.exception("ext_proc (EPP) message failed")
                    stream.failed = True
                    out = [_internal_error(self.director, stream.ex)]
                for resp in out:
                    yield resp
        finally:
            stream.ended()

    async def _observe(self, request_iterator: AsyncIterator[ep.ProcessingRequest],
                       until_first_token: bool = False) -> None:
        """Envoy sends and never waits for an answer; the gateway ends the stream itself once
        the response is over (Envoy would hold it open for its deferred-close timeout), or
        ``until_first_token`` once the first token has come: Envoy then sends nothing more,
        and its access log reports the end (:class:`AccessLogServicer`)."""
        ex: Exchange | None = None
        try:
            async for msg in request_iterator:
                try:
                    ex = self.streams.observe(ex, msg)
                except Exception:
                    log.exception("ext_proc observation failed")
                if ex is None or ex.done or (until_first_token and ex.first_token_s is not None):
                    break
        finally:
            self.streams.observing_ended(ex)


class AccessLogServicer(als_grpc.AccessLogServiceServicer):
    """Envoy's access log stream (one per Envoy worker thread, for as long as Envoy runs):
    each entry ends the request it names, when its observing stream stopped at the first
    token."""

    def __init__(self, streams: EnvoyStreams) -> None:
        self.streams = streams

    async def StreamAccessLogs(self, request_iterator: AsyncIterator[als.StreamAccessLogsMessage],
                               context: grpc.aio.ServicerContext
                               ) -> als.StreamAccessLogsResponse:
        async for msg in request_iterator:
            for entry in msg.http_logs.log_entry:
                try:
                    self.streams.logged(entry)
                except Exception:
                    log.exception("access log entry failed")
        return als.StreamAccessLogsResponse()
