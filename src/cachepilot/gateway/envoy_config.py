"""Envoy's bootstrap, generated: the local stack, the tests and the Helm chart all use this.

Requests pass the ext_proc filter (CachePilot picks a worker and writes its ``ip:port`` into
``x-gateway-destination-endpoint``), then an ORIGINAL_DST cluster connects to that address.
Fail-closed: the processor down → 500. Fail-open: the request goes on unprocessed, and a
route without the destination header sends it to a round-robin fallback cluster.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

import orjson
import yaml

from cachepilot.core.request import INFERENCE_PATHS
from cachepilot.gateway.service import (
    DECISION_HEADER,
    DESTINATION_HEADER,
    WORKER_HEADER,
)

_T = "type.googleapis.com/envoy."


@dataclass(frozen=True)
class EnvoyOptions:
    listen_address: str = "0.0.0.0"
    listen_port: int = 8080
    admin_address: str = "127.0.0.1"
    admin_port: int = 9901
    ext_proc_host: str = "127.0.0.1"
    ext_proc_port: int = 9002
    fail_open: bool = False
    fallback_workers: tuple[str, ...] = ()  # host:port; required with fail_open
    observe_responses: bool = True  # stream response bodies to the gateway (TTFT, cached tokens)
    max_body_bytes: int = 8 * 1024 * 1024
    message_timeout_ms: int = 500
    upstream_timeout_s: float = 0.0  # 0: no limit (long generations stream)
    connect_timeout_s: float = 2.0
    max_requests: int = 100_000  # circuit breakers: Envoy's default 1,024 caps load tests
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.fail_open and not self.fallback_workers:
            raise ValueError("fail-open needs fallback workers (host:port) to send requests to")
        for hp in self.fallback_workers:
            _split(hp)


def _split(hostport: str) -> tuple[str, int]:
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected host:port, got {hostport!r}")
    return host.strip("[]"), int(port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _addr(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _static_cluster(name: str, hosts: list[tuple[str, int]], *, http2: bool = False,
                    timeout_s: float = 2.0) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC" if all(_is_ip(h) for h, _ in hosts) else "STRICT_DNS",
        "connect_timeout": f"{timeout_s}s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _addr(h, p)}} for h, p in hosts]}]},
    }
    if http2:
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _T + "extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}}
    return cluster


def _breakers(n: int) -> dict[str, Any]:
    return {"thresholds": [{"priority": "DEFAULT", "max_connections": n,
                            "max_pending_requests": n, "max_requests": n, "max_retries": 3}]}


def _picked_or_fallback(o: EnvoyOptions, match: dict[str, Any], to_workers: dict[str, Any],
                        name: str) -> list[dict[str, Any]]:
    """Fail-closed: one route to ORIGINAL_DST (no destination header → 503). Fail-open: the
    gateway's header selects ORIGINAL_DST; without it (gateway down) round-robin fallback."""
    if not o.fail_open:
        return [{"name": name, "match": match, "route": to_workers}]
    picked = {**match, "headers": [*match.get("headers", []),
                                   {"name": DESTINATION_HEADER, "present_match": True}]}
    return [{"name": f"{name}-picked", "match": picked, "route": to_workers},
            {"name": f"{name}-fallback", "match": match,
             "route": {**to_workers, "cluster": "cachepilot_fallback"}}]


def _json_reply(status: int, message: str) -> dict[str, Any]:
    body = orjson.dumps({"error": {"message": message, "type": "invalid_request",
                                   "code": status}}).decode()
    return {"status": status, "body": {"inline_string": body}}


def _inference_routes(o: EnvoyOptions, path: str, to_workers: dict[str, Any]
                      ) -> list[dict[str, Any]]:
    """Inference routes stream the request body to the gateway, and its responses only when
    ``observe_responses`` is on."""
    per_route = {"envoy.filters.http.ext_proc": {
        "@type": _T + "extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
        "overrides": {
            "processing_mode": {
                "request_header_mode": "SEND", "request_body_mode": "STREAMED",
                "request_trailer_mode": "SKIP",
                "response_header_mode": "SEND" if o.observe_responses else "SKIP",
                "response_body_mode": "STREAMED" if o.observe_responses else "NONE",
                "response_trailer_mode": "SKIP"}}}}
    post = {"path": path, "headers": [{"name": ":method", "string_match": {"exact": "POST"}}]}
    routes = [
        # No body means no ext_proc message at all: answer here.
        {"name": f"{path}-empty", "match": {**post, "headers": [
            *post["headers"], {"name": "content-length", "string_match": {"exact": "0"}}]},
         "direct_response": _json_reply(400, "request body is empty")},
        {"name": f"{path}-method", "match": {"path": path, "headers": [
            {"name": ":method", "string_match": {"exact": "POST"}, "invert_match": True}]},
         "direct_response": _json_reply(405, f"{path} takes POST")},
    ]
    for r in _picked_or_fallback(o, post, to_workers, path):
        r["typed_per_filter_config"] = per_route
        if not o.observe_responses:  # the gateway never sees the response: Envoy adds these
            r["response_headers_to_add"] = [
                {"header": {"key": DECISION_HEADER, "value": f"%REQ({DECISION_HEADER})%"},
                 "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"},
                {"header": {"key": WORKER_HEADER, "value": f"%REQ({DESTINATION_HEADER})%"},
                 "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]
        routes.append(r)
    return routes


def build_bootstrap(o: EnvoyOptions) -> dict[str, Any]:
    """The whole bootstrap as a dict (dump it as YAML or JSON)."""
    # Filter-wide mode serves non-inference paths (GET /v1/models, /health): headers only, and
    # the gateway names any ready worker. Inference routes override it (_inference_routes).
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _T + "extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "cachepilot_ext_proc"},
                             "timeout": "5s"},
            "failure_mode_allow": o.fail_open,
            "message_timeout": f"{o.message_timeout_ms / 1000:.3f}s",
            # Stream the body at once: the gateway answers the headers when it has the body,
            # so a decision costs one round trip (STREAMED mode only).
            "send_body_without_waiting_for_header_response": True,
            "processing_mode": {
                "request_header_mode": "SEND", "request_body_mode": "NONE",
                "request_trailer_mode": "SKIP", "response_header_mode": "SKIP",
                "response_body_mode": "NONE", "response_trailer_mode": "SKIP"},
        },
    }
    to_workers = {"cluster": "cachepilot_workers", "timeout": f"{o.upstream_timeout_s}s",
                  "idle_timeout": "300s"}
    routes: list[dict[str, Any]] = []
    for path in INFERENCE_PATHS:
        routes += _inference_routes(o, path, to_workers)
    routes += _picked_or_fallback(o, {"prefix": "/"}, to_workers, "other")
    hcm = {
        "@type": _T + "extensions.filters.network.http_connection_manager.v3"
                      ".HttpConnectionManager",
        "stat_prefix": "cachepilot",
        "codec_type": "AUTO",
        # A client must not pick the upstream itself: drop the header before any filter runs.
        "early_header_mutation_extensions": [{
            "name": "envoy.http.early_header_mutation.header_mutation",
            "typed_config": {
                "@type": _T + "extensions.http.early_header_mutation.header_mutation.v3"
                              ".HeaderMutation",
                "mutations": [{"remove": DESTINATION_HEADER}]}}],
        "route_config": {"name": "cachepilot", "virtual_hosts": [
            {"name": "inference", "domains": ["*"], "routes": routes}]},
        "http_filters": [ext_proc, {"name": "envoy.filters.http.router", "typed_config": {
            "@type": _T + "extensions.filters.http.router.v3.Router"}}],
        "stream_idle_timeout": "300s",
        "request_timeout": "0s",
    }
    workers = {
        "name": "cachepilot_workers",
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": f"{o.connect_timeout_s}s",
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
        "cleanup_interval": "60s",
        "circuit_breakers": _breakers(o.max_requests),
    }
    clusters = [
        _static_cluster("cachepilot_ext_proc", [(o.ext_proc_host, o.ext_proc_port)], http2=True),
        workers,
    ]
    if o.fail_open:
        fb = _static_cluster("cachepilot_fallback", [_split(h) for h in o.fallback_workers],
                             timeout_s=o.connect_timeout_s)
        fb["circuit_breakers"] = _breakers(o.max_requests)
        clusters.append(fb)
    clusters[0]["circuit_breakers"] = _breakers(o.max_requests)
    return {
        "admin": {"address": _addr(o.admin_address, o.admin_port)},
        "static_resources": {
            "listeners": [{
                "name": "cachepilot",
                "address": _addr(o.listen_address, o.listen_port),
                # Envoy holds a request body until the gateway has routed it. Room for the
                # largest accepted body and then some, so that the gateway, seeing more than
                # max_body_bytes arrive, answers 413 in JSON before Envoy's buffer is full.
                "per_connection_buffer_limit_bytes": o.max_body_bytes + 256 * 1024,
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": hcm}]}],
            }],
            "clusters": clusters,
        },
        **o.extra,
    }


def render(o: EnvoyOptions, fmt: str = "yaml") -> str:
    config = build_bootstrap(o)
    if fmt == "json":
        return orjson.dumps(config, option=orjson.OPT_INDENT_2).decode()
    return yaml.safe_dump(config, sort_keys=False)
