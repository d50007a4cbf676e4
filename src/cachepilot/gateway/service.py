"""Envoy's ExternalProcessor service: each stream goes to the protocol it speaks.

CachePilot's own Envoy config (:mod:`cachepilot.gateway.envoy_config`) opens two kinds of
stream, told apart by the gRPC metadata its per-route config adds (``x-cachepilot-role:
observe`` on an observing stream):

Routing stream (one per request; Envoy waits for its answers). By default (metadata
``x-cachepilot-body: only``) it carries one message, the whole request body: Envoy's route
matched the method and path (named in ``x-cachepilot-path``) and refused declared lengths
over the limit, so the gateway parses, routes and answers once, with the ordered fallback
list, the chosen worker and the decision id in ``envoy.lb`` metadata, or with a JSON error
(ImmediateResponse). A buffer filter after ext_proc holds the request headers until that
answer (ext_proc passes on headers it does not send), and the answer clears the route cache,
so the route and the workers' cluster see the metadata: one message each way. Other
configurations are understood too: a headers message first (``x-cachepilot-body:
buffered``: the headers answered at once, the body's answer routes with the destination
header as well: two round trips), a STREAMED body (the headers answered at the last chunk,
then one answer per chunk), and a routing stream that also carries the response
(``observe_async`` off in Envoy's config). Non-inference requests (GET /v1/models, /health)
send their headers, answered at once with any ready worker.

Observing stream (``observability_mode``: Envoy sends and never waits, so observation costs
the client nothing). The request headers come with the decision id the routing stream set
(forwarded ``envoy.lb`` metadata, or a header in the headers-message configuration); then
response headers (status, who answered: failover, first byte) and response body chunks
(first token time, the worker's cached-token count). Only a 2xx answer from the chosen worker
is model output: an error, or an answer from the runner-up Envoy failed over to, never counts
as the chosen worker's first token. The response's end, or the stream's end however it ends,
releases the request's place on its worker and records the outcome.

Any other gateway speaks the endpoint picker protocol (:mod:`cachepilot.gateway.epp`). With
``GatewayOptions.protocol`` "auto" a stream whose metadata has an ``x-cachepilot-*`` key is
ours (our generated config puts one on every stream), any other one EPP.

The state machine itself is :class:`cachepilot.gateway.processor.Processor`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from cachepilot.core.request import RequestError
from cachepilot.gateway.epp import EppStream
from cachepilot.gateway.processor import (
    DecisionSink,
    Exchange,
    GatewayOptions,
    Processor,
)
from cachepilot.gateway.protocol import (
    BODY_METADATA,
    BODY_ONLY,
    BUFFERED_BODY,
    DECISION_HEADER,
    DESTINATION_HEADER,
    ERROR_HEADER,
    FALLBACKS,
    LB_METADATA_NAMESPACE,
    METADATA_PREFIX,
    OBSERVE_METADATA,
    OBSERVE_ROLE,
    PATH_METADATA,
    ROLE_METADATA,
    ROUTE_ROLE,
    WORKER_HEADER,
    fallback_list,
    immediate,
)

log = logging.getLogger("cachepilot.extproc")

PROTOCOLS = ("auto", "cachepilot", "epp")

__all__ = [
    "BODY_METADATA", "BUFFERED_BODY", "DECISION_HEADER", "DESTINATION_HEADER", "ERROR_HEADER",
    "FALLBACKS", "LB_METADATA_NAMESPACE", "OBSERVE_METADATA", "OBSERVE_ROLE", "PROTOCOLS",
    "ROLE_METADATA", "ROUTE_ROLE", "WORKER_HEADER", "DecisionSink", "Exchange",
    "ExtProcServicer", "GatewayOptions", "Processor", "fallback_list", "immediate",
]


def _stream_kind(context: grpc.aio.ServicerContext | None) -> tuple[str, bool, Exchange]:
    """(role, ours, the stream's Exchange) from the metadata Envoy's per-route config adds to
    a stream; ``ours``: it has an x-cachepilot-* key."""
    role, ours, ex = "", False, Exchange()
    if context is not None:
        for key, value in context.invocation_metadata() or ():
            if key.startswith(METADATA_PREFIX):
                ours = True
            if key == ROLE_METADATA:
                role = value
            elif key == BODY_METADATA:
                ex.buffered = value == BUFFERED_BODY
                ex.body_only = value == BODY_ONLY
            elif key == OBSERVE_METADATA:
                ex.observe = value
            elif key == PATH_METADATA:
                ex.path = value
    return role, ours, ex


class ExtProcServicer(ep_grpc.ExternalProcessorServicer):
    """grpc.aio adapter: one Exchange per stream; never lets an exception kill the server."""

    def __init__(self, processor: Processor) -> None:
        self.processor = processor

    def _epp(self, ours: bool) -> bool:
        protocol = self.processor.options.protocol
        return protocol == "epp" or (protocol == "auto" and not ours)

    async def Process(self, request_iterator: AsyncIterator[ep.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[ep.ProcessingResponse]:
        role, ours, ex = _stream_kind(context)
        if self._epp(ours):
            async for resp in self._epp_stream(request_iterator):
                yield resp
            return
        if role == OBSERVE_ROLE:
            await self._observe(request_iterator)
            return
        # A body-only stream whose response goes elsewhere (an observing stream, or nowhere)
        # is done once its one message is answered: end it then, rather than wake again for
        # Envoy's close at the request's end (Envoy ignores a stream its server closed).
        done_after_answer = ex.body_only and ex.observe != "sync"
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
                if done_after_answer:
                    return
        finally:
            self.processor.stream_ended(ex)

    async def _epp_stream(self, request_iterator: AsyncIterator[ep.ProcessingRequest]
                          ) -> AsyncIterator[ep.ProcessingResponse]:
        stream = EppStream(self.processor)
        try:
            async for msg in request_iterator:
                try:
                    out = stream.handle(msg)
                except Exception:  # a bug must cost one request, not the gateway
                    log.exception("ext_proc (EPP) message failed")
                    stream.failed = True
                    out = [immediate(RequestError(500, "internal routing error",
                                                  code="internal_error"))]
                for resp in out:
                    yield resp
        finally:
            stream.ended()

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
