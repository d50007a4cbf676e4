"""Envoy in front of an endpoint picker (any EPP; CachePilot's with ``--protocol epp`` or
``auto``), as the reference gateways configure it; ``extproc/envoy-epp.yaml`` is its output.

Followed: gateway-api-inference-extension test/testdata/envoy.yaml and
config/charts/standalone/values.yaml (at 1748e829, the last tree with the full EPP): one
ext_proc filter sending request and response headers, FULL_DUPLEX_STREAMED bodies both ways
and trailers (SEND), a 1000 s message timeout, no allow_mode_override, a gRPC health check of
the EPP on "envoy.service.ext_proc.v3.ExternalProcessor", and an ORIGINAL_DST cluster on the
x-gateway-destination-endpoint header. docs/epp.md explains the additions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cachepilot.deploy.envoy.common import (
    T,
    bootstrap,
    breakers,
    check_hostports,
    ext_proc_filter,
    fallback_cluster,
    header,
    http_connection_manager,
    original_dst_cluster,
    override_host_cluster,
    picked_or_fallback,
    processing_mode,
    router_filter,
    static_cluster,
)
from cachepilot.gateway.protocol import (
    DESTINATION_HEADER,
    LB_METADATA_NAMESPACE,
    SERVED_KEY,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
)

EPP_HEALTH_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
EPP_CLUSTER = "epp"
POOL_CLUSTER = "inference_pool"
FALLBACK_CLUSTER = "epp_fallback"


@dataclass(frozen=True)
class EppEnvoyOptions:
    listen_address: str = "0.0.0.0"
    listen_port: int = 8081
    admin_address: str = "127.0.0.1"
    admin_port: int = 19000
    epp_host: str = "127.0.0.1"  # the endpoint picker (any, not only CachePilot)
    epp_port: int = 9002
    # InferencePool failureMode: FailClose (failure_mode_allow false, as the reference Envoy:
    # EPP unreachable → 5xx) or FailOpen (the request goes on; without a destination it is
    # sent round robin to fallback_workers, or to `workers` when they are known).
    fail_open: bool = False
    fallback_workers: tuple[str, ...] = ()
    # Known workers (ip:port): an override-host cluster that reads the EPP's envoy.lb
    # metadata first, then the header (a list walks on retries). None known: the reference's
    # ORIGINAL_DST cluster on the header.
    workers: tuple[str, ...] = ()
    # Report who served each response (envoy.lb / x-gateway-destination-endpoint-served) to
    # the EPP on the response messages, as the protocol asks of the data plane.
    report_served: bool = True
    # Let a request header x-gateway-destination-endpoint-subset become the subset hint
    # (envoy.lb.subset_hint metadata), the way a gateway sets it from its own state. For
    # tests: it lets a client restrict the endpoints.
    subset_from_header: bool = False
    generate_request_id: bool = True  # Envoy's default; off, the EPP must generate one
    message_timeout_s: float = 1000.0  # the reference's
    route_timeout_s: float = 86400.0  # the reference's: long generations stream
    health_check_interval_s: float = 10.0  # the reference's; 0: no health check
    retries: int = 0  # per request, along the EPP's endpoint list (override-host cluster)
    max_requests: int = 40_000  # the reference's circuit breakers
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.fail_open and not (self.fallback_workers or self.workers):
            raise ValueError("fail-open needs fallback workers (host:port) to send requests to")
        check_hostports(*self.fallback_workers, *self.workers)


def _epp_cluster(o: EppEnvoyOptions) -> dict[str, Any]:
    cluster = static_cluster(EPP_CLUSTER, [(o.epp_host, o.epp_port)], http2=True)
    cluster["lb_policy"] = "LEAST_REQUEST"
    cluster["circuit_breakers"] = breakers(o.max_requests)
    if o.health_check_interval_s > 0:
        cluster["health_checks"] = [{
            "timeout": "2s", "interval": f"{o.health_check_interval_s}s",
            "unhealthy_threshold": 3, "healthy_threshold": 2, "reuse_connection": True,
            "grpc_health_check": {"service_name": EPP_HEALTH_SERVICE}}]
    return cluster


def ext_proc(o: EppEnvoyOptions) -> dict[str, Any]:
    """The ext_proc filter as the reference gateway configures it for an EPP."""
    return ext_proc_filter(
        EPP_CLUSTER, timeout_s=10.0,
        mode=processing_mode(request_header="SEND", response_header="SEND",
                             request_body="FULL_DUPLEX_STREAMED",
                             response_body="FULL_DUPLEX_STREAMED",
                             request_trailer="SEND", response_trailer="SEND"),
        failure_mode_allow=o.fail_open,
        message_timeout=f"{o.message_timeout_s:g}s",
        # The subset hint and the served endpoint go to the EPP; its envoy.lb answer (the
        # destination) is accepted for the override-host cluster.
        metadata_options={
            "forwarding_namespaces": {"untyped": [SUBSET_NAMESPACE, LB_METADATA_NAMESPACE]},
            "receiving_namespaces": {"untyped": [LB_METADATA_NAMESPACE]}})


def _header_to_metadata(rules_key: str, header_name: str, namespace: str, key: str
                        ) -> dict[str, Any]:
    return {"name": "envoy.filters.http.header_to_metadata", "typed_config": {
        "@type": T + "extensions.filters.http.header_to_metadata.v3.Config",
        rules_key: [{"header": header_name, "remove": True, "on_header_present": {
            "metadata_namespace": namespace, "key": key, "type": "STRING"}}]}}


def routes(o: EppEnvoyOptions, cluster: str, name: str = "inference") -> list[dict[str, Any]]:
    """Everything to the pool; fail-open: requests the EPP named no worker for (it was
    down) go round robin to the fallback cluster (known workers' override-host cluster
    falls back on its own)."""
    route: dict[str, Any] = {"cluster": cluster, "timeout": f"{o.route_timeout_s:g}s",
                             "idle_timeout": f"{o.route_timeout_s:g}s"}
    if o.retries:
        route["retry_policy"] = {"retry_on": "connect-failure,refused-stream,reset-before-request",
                                 "num_retries": o.retries}
    served = [header(SERVED_KEY, "%UPSTREAM_HOST%")] if o.report_served else []
    return picked_or_fallback(name, {"prefix": "/"}, route, served,
                              split_routes=o.fail_open and not o.workers,
                              fallback=FALLBACK_CLUSTER)


def build(o: EppEnvoyOptions) -> dict[str, Any]:
    """Envoy in front of an endpoint picker (docs/epp.md), as a dict."""
    workers = (override_host_cluster(POOL_CLUSTER, o.workers, max_requests=o.max_requests)
               if o.workers else
               original_dst_cluster(POOL_CLUSTER, timeout_s=5, max_requests=o.max_requests))
    filters: list[dict[str, Any]] = []
    if o.subset_from_header:  # decoded before ext_proc: the EPP sees the hint
        filters.append(_header_to_metadata("request_rules", SUBSET_KEY, SUBSET_NAMESPACE,
                                           SUBSET_KEY))
    filters.append(ext_proc(o))
    if o.report_served:  # encoded before ext_proc: the EPP sees who served
        filters.append(_header_to_metadata("response_rules", SERVED_KEY, LB_METADATA_NAMESPACE,
                                           SERVED_KEY))
    filters.append(router_filter(suppress_envoy_headers=True))
    hcm = http_connection_manager(
        "epp_gateway", remove_headers=(DESTINATION_HEADER, SERVED_KEY),
        route_config_name="inference", routes=routes(o, POOL_CLUSTER), filters=filters,
        generate_request_id=o.generate_request_id)
    clusters = [_epp_cluster(o), workers]
    if o.fail_open and not o.workers:
        clusters.append(fallback_cluster(FALLBACK_CLUSTER, o.fallback_workers, o.max_requests))
    return bootstrap(admin=(o.admin_address, o.admin_port), listener="epp_gateway",
                     listen=(o.listen_address, o.listen_port), hcm=hcm, clusters=clusters,
                     extra=o.extra)
