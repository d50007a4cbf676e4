"""The destination: the header, the ``envoy.lb`` metadata and the two compared in full, the
``ip:port`` format with IPv6, the pool without a hint; and the health services."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cachepilot.conformance.envoy import HEADER_HOST, METADATA_HOST
from cachepilot.conformance.rules import (
    PROTOCOL,
    Context,
    canonical,
    endpoints,
    expect,
    rule,
)
from cachepilot.conformance.sources import envoy_doc, epp, issue, lwepp, proto

_EACH = proto("L50", "For each HTTP request, the EPP MUST communicate to the data plane one "
                     "or more selected model server endpoints via:")
_FORMAT = proto("L73", "The value of the header or metadata entry MUST contain at least one "
                       "endpoint in `<ip:port>` format or multiple endpoints in "
                       "`<ip:port>,<ip:port>,...` format. Multiple endpoints are separated by "
                       "commas. The first valid endpoint in the list will be used.")


@rule("P01", "DestinationHeader", PROTOCOL,
      "Every routed request carries x-gateway-destination-endpoint naming one or more pool "
      "endpoints (ip:port, comma-separated); a proxy routing on the header alone reaches the "
      "first.",
      _EACH,
      proto("L52", "1. Setting the `x-gateway-destination-endpoint` HTTP header to one or "
                   "more selected endpoints."),
      _FORMAT)
async def check_destination_header(ctx: Context) -> None:
    for i in range(6):
        r = await ctx.post(ctx.body(f"header {i}"), host=HEADER_HOST)
        expect(r, 200, "request through the header-routed cluster")
        header, _ = r.destinations()
        named = endpoints(header)
        assert named, f"worker {r.worker} got no x-gateway-destination-endpoint"
        pool = {canonical(a) for a in ctx.addresses}
        assert all(canonical(e) in pool for e in named), (
            f"the header names {header!r}, not only pool endpoints")
        assert canonical(named[0]) == canonical(r.worker), (
            f"the header names {header!r} first, the header-routed cluster reached "
            f"{r.worker}")


@rule("P02", "DestinationMetadataEqualsHeader", PROTOCOL,
      "The same endpoints are set in dynamic metadata envoy.lb/x-gateway-destination-endpoint:"
      " the metadata string equals the header string in full (every endpoint, in order), and "
      "a proxy routing on the metadata alone reaches its first endpoint.",
      proto("L54", "2. Set an unstructured entry in the dynamic_metadata field of the ext-proc "
                   "response. The metadata entry for the picked endpoints MUST be wrapped with "
                   "an outer key (which represents the metadata namespace) with a default of "
                   "`envoy.lb`."),
      proto("L81", "The EPP MUST not set two different values in the header and the inner "
                   "response metadata value."))
async def check_destination_metadata(ctx: Context) -> None:
    for i in range(6):
        r = await ctx.post(ctx.body(f"metadata {i}"), host=METADATA_HOST)
        expect(r, 200, "request through the metadata-routed cluster")
        header, meta = r.destinations()
        assert meta, f"no envoy.lb/x-gateway-destination-endpoint metadata (header {header!r})"
        assert header is None or header == meta, (
            f"the header says {header!r}, the metadata {meta!r}")
        assert canonical(endpoints(meta)[0]) == canonical(r.worker), (
            f"the metadata names {meta!r} first, the metadata-routed cluster reached "
            f"{r.worker}")


@rule("P03", "IPv6Endpoint", PROTOCOL,
      "An IPv6 endpoint is written [addr]:port, in the subset hint and in the destination, and "
      "a proxy reaches it (interpretation: the proposal says only <ip:port>; the reference "
      "EPP and Envoy write IPv6 so, and an unbracketed ::1:port does not route).",
      _FORMAT,
      epp("pkg/epp/requestcontrol/director.go", "L326",
          "net.JoinHostPort(address, port) writes [addr]:port"),
      epp("pkg/epp/handlers/request.go", "L50",
          "but its bodyless path writes GetIPAddress() + \":\" + GetPort(), unbracketed"),
      lwepp("pkg/lwepp/handlers/server.go", "L99", "net.JoinHostPort"),
      envoy_doc("https://www.envoyproxy.io/docs/envoy/latest/api-v3/extensions/"
                "load_balancing_policies/override_host/v3/override_host.proto",
                "For example 10.0.0.5:8080 or [2600:4040:5204::1574:24ae]:80. The IPv6 address "
                "is enclosed in square brackets."),
      issue("https://github.com/ai-dynamo/dynamo/pull/12064",
            "fix(ext-proc): support IPv6 EPP endpoints: format as [IPv6]:port, fix IPv6 subset "
            "matching"),
      needs=("ipv6",))
async def check_ipv6_endpoint(ctx: Context) -> None:
    for v6 in ctx.ipv6:
        for i in range(8):  # an EPP ignoring the hint would pick another one by now
            r = await ctx.post(ctx.body(f"ipv6 {i}"), hint=[v6])
            expect(r, 200, f"request with the subset hint [{v6!r}]")
            header, meta = r.destinations()
            for value in (header, meta):
                for e in endpoints(value):
                    if canonical(e) == canonical(v6):
                        assert e.startswith("["), f"IPv6 endpoint written {e!r}, not {v6!r}"
            assert r.worker == v6, (f"the hint named {v6} only; the destination was header "
                                    f"{header!r}, metadata {meta!r}, reached {r.worker}")


@rule("P04", "PoolWithoutHint", PROTOCOL,
      "Without a subset hint every endpoint the EPP names is one of its pool's (checked on up "
      "to 24 requests, stopping once every pool endpoint was named).",
      proto("L44", "If the key `x-gateway-destination-endpoint-subset` is not set, then the "
                   "EPP MUST select from the set defined by the `InferencePool` selector."))
async def check_pool_without_hint(ctx: Context) -> None:
    pool = {canonical(a) for a in ctx.addresses}
    named: set[str] = set()
    for i in range(24):
        r = await ctx.post(ctx.body(f"pool {i}"), hint=None)
        expect(r, 200, "request without a subset hint")
        header, meta = r.destinations()
        for e in endpoints(header) + endpoints(meta):
            assert canonical(e) in pool, f"named {e!r}, not an endpoint of the pool {sorted(pool)}"
            named.add(canonical(e))
        if named == pool:
            return


@rule("P14", "HealthServices", PROTOCOL,
      "The EPP serves the gRPC health protocol: liveness, readiness and "
      "envoy.service.ext_proc.v3.ExternalProcessor answer SERVING.",
      proto("L105", "The EPP MUST expose health check endpoints following the gRPC Health "
                    "Checking Protocol."),
      proto("L109-115", "The EPP exposes the following health check services: liveness, "
                        "readiness, envoy.service.ext_proc.v3.ExternalProcessor"))
async def check_health_services(ctx: Context) -> None:
    host, port = ctx.cfg.epp
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            try:
                resp = await stub.Check(health_pb2.HealthCheckRequest(service=service),
                                        timeout=5)
            except grpc.aio.AioRpcError as err:
                raise AssertionError(f"{service}: {err.code().name} {err.details()}") from None
            assert resp.status == health_pb2.HealthCheckResponse.SERVING, \
                f"{service}: {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}"
