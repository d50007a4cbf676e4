"""What both Envoy bootstraps are built from: addresses, clusters, the ext_proc and router
filters, the HTTP connection manager, the listener and the bootstrap around them.

Our bootstrap (:mod:`.ours`) and the endpoint picker's (:mod:`.epp`) differ in their filters
and routes, not in how a cluster, a listener or a fail-open route pair is spelled; those
builders live here once, so a fix to one (a circuit breaker, the override-host fallback)
reaches both.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from cachepilot.gateway.protocol import DESTINATION_HEADER, LB_METADATA_NAMESPACE

T = "type.googleapis.com/envoy."
EXT_PROC_TYPE = T + "extensions.filters.http.ext_proc.v3.ExternalProcessor"
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
OVERWRITE = "OVERWRITE_IF_EXISTS_OR_ADD"


def split(hostport: str) -> tuple[str, int]:
    """``host:port`` (IPv6 in brackets) → (host, port); ValueError otherwise."""
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected host:port, got {hostport!r}")
    return host.strip("[]"), int(port)


def check_hostports(*hostports: str) -> None:
    for hp in hostports:
        split(hp)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def addr(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def header(key: str, value: str) -> dict[str, Any]:
    """A header to add, replacing any the request or response already has."""
    return {"header": {"key": key, "value": value}, "append_action": OVERWRITE}


def processing_mode(*, request_header: str = "SKIP", request_body: str = "NONE",
                    request_trailer: str = "SKIP", response_header: str = "SKIP",
                    response_body: str = "NONE", response_trailer: str = "SKIP"
                    ) -> dict[str, str]:
    """An ext_proc processing mode; the defaults send Envoy's processor nothing."""
    return {"request_header_mode": request_header, "request_body_mode": request_body,
            "request_trailer_mode": request_trailer, "response_header_mode": response_header,
            "response_body_mode": response_body, "response_trailer_mode": response_trailer}


# -- clusters -----------------------------------------------------------------------------------
def breakers(n: int) -> dict[str, Any]:
    return {"thresholds": [{"priority": "DEFAULT", "max_connections": n,
                            "max_pending_requests": n, "max_requests": n, "max_retries": 3}]}


def static_cluster(name: str, hosts: list[tuple[str, int]], *, http2: bool = False,
                   timeout_s: float = 2.0) -> dict[str, Any]:
    """Round robin over fixed hosts: STATIC for IP addresses, STRICT_DNS for names."""
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC" if all(_is_ip(h) for h, _ in hosts) else "STRICT_DNS",
        "connect_timeout": f"{timeout_s}s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": addr(h, p)}} for h, p in hosts]}]},
    }
    if http2:
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": T + "extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}}
    return cluster


# Inference servers close idle keep-alive connections after 5 s (llama.cpp's cpp-httplib,
# vLLM's uvicorn); a request Envoy sends on one as it closes dies with a connection reset
# after it left (not retriable: it may have reached the worker). Envoy closes first.
WORKER_IDLE_TIMEOUT = "3s"


def worker_connections(requests_per_connection: int = 0) -> dict[str, Any]:
    """Upstream protocol options for clusters of inference workers. ``requests_per_connection``
    1 for workers that close a connection they said they would keep: llama-server answers a
    streamed request with ``Keep-Alive: timeout=5, max=100`` and then closes it
    (``tests/tooling/test_llamacpp.py``), so a request Envoy sends on it at once, as a
    held request released when that answer ends is, meets the close: a 503. 0: no limit."""
    common: dict[str, Any] = {"idle_timeout": WORKER_IDLE_TIMEOUT}
    if requests_per_connection:
        common["max_requests_per_connection"] = requests_per_connection
    return {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": T + "extensions.upstreams.http.v3.HttpProtocolOptions",
        "common_http_protocol_options": common,
        "explicit_http_config": {"http_protocol_options": {}}}}


def fallback_cluster(name: str, workers: tuple[str, ...], max_requests: int,
                     timeout_s: float = 2.0, requests_per_connection: int = 0
                     ) -> dict[str, Any]:
    """Fail-open's destination when no worker was named: round robin over ``workers``."""
    cluster = static_cluster(name, [split(h) for h in workers], timeout_s=timeout_s)
    cluster["circuit_breakers"] = breakers(max_requests)
    cluster["typed_extension_protocol_options"] = worker_connections(requests_per_connection)
    return cluster


def override_host_cluster(name: str, workers: tuple[str, ...], *,
                          sources: tuple[str, ...] = ("metadata", "header"),
                          timeout_s: float = 2.0, max_requests: int = 40_000,
                          requests_per_connection: int = 0) -> dict[str, Any]:
    """Known workers behind Envoy's override-host load balancer, reading the chosen worker
    (an ordered ``ip:port,…`` list, walked on retries) from ``sources`` in order:
    ``envoy.lb`` metadata and/or the destination header. Without either, round robin (the
    fail-open path; unreached while the picker names a worker of this cluster)."""
    cluster = static_cluster(name, [split(h) for h in workers], timeout_s=timeout_s)
    del cluster["lb_policy"]
    found = {"metadata": {"metadata": {"key": LB_METADATA_NAMESPACE,
                                       "path": [{"key": DESTINATION_HEADER}]}},
             "header": {"header": DESTINATION_HEADER}}
    cluster["load_balancing_policy"] = {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.override_host",
        "typed_config": {
            "@type": T + "extensions.load_balancing_policies.override_host.v3.OverrideHost",
            "override_host_sources": [found[s] for s in sources],
            "fallback_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.round_robin",
                "typed_config": {"@type": T + "extensions.load_balancing_policies.round_robin"
                                              ".v3.RoundRobin"}}}]}}}}]}
    cluster["circuit_breakers"] = breakers(max_requests)
    cluster["typed_extension_protocol_options"] = worker_connections(requests_per_connection)
    return cluster


def original_dst_cluster(name: str, *, timeout_s: float, max_requests: int,
                         metadata_key: str | None = None, requests_per_connection: int = 0,
                         **fields: Any) -> dict[str, Any]:
    """Workers found at run time: connect to whatever ``ip:port`` the picker named, from
    ``envoy.lb`` metadata ``metadata_key`` when given, else the destination header. It
    cannot take a list, so a retry goes to the same worker."""
    lb: dict[str, Any] = {"use_http_header": True, "http_header_name": DESTINATION_HEADER}
    if metadata_key:
        lb["metadata_key"] = {"key": LB_METADATA_NAMESPACE, "path": [{"key": metadata_key}]}
    return {"name": name, "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": f"{timeout_s}s", "original_dst_lb_config": lb, **fields,
            "circuit_breakers": breakers(max_requests),
            "typed_extension_protocol_options": worker_connections(requests_per_connection)}


# -- filters and routes -------------------------------------------------------------------------
def ext_proc_filter(cluster: str, *, mode: dict[str, str], timeout_s: float,
                    name: str = EXT_PROC_FILTER,
                    initial_metadata: list[tuple[str, str]] | None = None,
                    **fields: Any) -> dict[str, Any]:
    """An ext_proc filter calling ``cluster`` over gRPC; ``fields`` are the filter's other
    settings (failure mode, metadata namespaces, timeouts, observability)."""
    grpc: dict[str, Any] = {"envoy_grpc": {"cluster_name": cluster}, "timeout": f"{timeout_s:g}s"}
    if initial_metadata:
        grpc["initial_metadata"] = [{"key": k, "value": v} for k, v in initial_metadata]
    return {"name": name, "typed_config": {"@type": EXT_PROC_TYPE, "grpc_service": grpc,
                                           **fields, "processing_mode": mode}}


def router_filter(**fields: Any) -> dict[str, Any]:
    return {"name": "envoy.filters.http.router", "typed_config": {
        "@type": T + "extensions.filters.http.router.v3.Router", **fields}}


def lb_matcher(key: str, value: dict[str, Any]) -> dict[str, Any]:
    """A route's match on the routing answer's envoy.lb metadata ``key`` (a ValueMatcher)."""
    return {"filter": LB_METADATA_NAMESPACE, "path": [{"key": key}], "value": value}


def picked_or_fallback(name: str, match: dict[str, Any], route: dict[str, Any],
                       headers: list[dict[str, Any]], *, split_routes: bool,
                       fallback: str, by_metadata: bool = False) -> list[dict[str, Any]]:
    """One route to the workers, or (``split_routes``: fail-open) two: requests the picker
    named a worker for (the destination header, or ``envoy.lb`` metadata ``by_metadata``)
    go to the workers' cluster; the rest (the picker was down) round robin to
    ``fallback``. ``headers`` are added to every response."""
    if not split_routes:
        return [{"name": name, "match": match, "route": route,
                 "response_headers_to_add": headers}]
    picked = ({**match, "dynamic_metadata": [
        lb_matcher(DESTINATION_HEADER, {"present_match": True})]} if by_metadata else
        {**match, "headers": [*match.get("headers", []),
                              {"name": DESTINATION_HEADER, "present_match": True}]})
    return [{"name": f"{name}-picked", "match": picked, "route": route,
             "response_headers_to_add": headers},
            {"name": f"{name}-fallback", "match": match,
             "route": {**route, "cluster": fallback}, "response_headers_to_add": headers}]


def http_connection_manager(stat_prefix: str, *, remove_headers: tuple[str, ...],
                            route_config_name: str, routes: list[dict[str, Any]],
                            filters: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    """The HTTP connection manager: one virtual host for every domain. ``remove_headers``
    are dropped before any filter runs (a client must not pick the upstream itself)."""
    return {
        "@type": T + "extensions.filters.network.http_connection_manager.v3"
                     ".HttpConnectionManager",
        "stat_prefix": stat_prefix,
        "codec_type": "AUTO",
        "early_header_mutation_extensions": [{
            "name": "envoy.http.early_header_mutation.header_mutation",
            "typed_config": {
                "@type": T + "extensions.http.early_header_mutation.header_mutation.v3"
                             ".HeaderMutation",
                "mutations": [{"remove": h} for h in remove_headers]}}],
        "route_config": {"name": route_config_name, "virtual_hosts": [
            {"name": "inference", "domains": ["*"], "routes": routes}]},
        "http_filters": filters,
        **fields,
    }


def bootstrap(*, admin: tuple[str, int], listener: str, listen: tuple[str, int],
              hcm: dict[str, Any], clusters: list[dict[str, Any]],
              network_filters: tuple[dict[str, Any], ...] = (),
              listener_fields: dict[str, Any] | None = None,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A whole static bootstrap: the admin address, one listener (``network_filters``, then
    the HTTP connection manager ``hcm``) and the clusters; ``extra`` top-level keys last."""
    return {
        "admin": {"address": addr(*admin)},
        "static_resources": {
            "listeners": [{
                "name": listener,
                "address": addr(*listen),
                **(listener_fields or {}),
                "filter_chains": [{"filters": [
                    *network_filters,
                    {"name": "envoy.filters.network.http_connection_manager",
                     "typed_config": hcm}]}],
            }],
            "clusters": clusters,
        },
        **(extra or {}),
    }
