"""Envoy's bootstrap, generated: the local stack, the tests and the Helm chart all use this.

Requests pass the ext_proc filter (CachePilot picks a worker and names its ``ip:port`` in
``envoy.lb`` metadata), then the workers' cluster connects to that address. Envoy buffers the
body and sends it whole as the routing stream's only message (no headers message: a buffer
filter holds the headers meanwhile); the answer carries the fallback list, the chosen worker
and the decision id, one round trip each way (``send_request_headers`` adds the headers
message back, answered at once, and the destination header). A second ext_proc filter in
``observability_mode`` shows the gateway the request's decision id and the response (status,
first byte and token, cached tokens) without Envoy ever waiting for it. Bodies over
``max_body_bytes`` are refused by the route (content-length) or by Envoy's buffer limit
(chunked), in the gateway's JSON error body.

* workers known up front (the local stacks): a STATIC cluster with Envoy's override-host
  load balancer, which reads the gateway's ordered list (``envoy.lb`` metadata, as the Gateway
  API Inference Extension's endpoint picker writes it: ``ip:port,ip:port,…``) and walks it on
  retries, so a request that never reached a dead worker goes to the runner-up at once;
* workers found at run time (Kubernetes): an ORIGINAL_DST cluster on the chosen worker alone
  (metadata, else the header; it cannot take a list, so a retry goes to the same worker).

Fail-closed: the processor down → 503 + Retry-After. Fail-open: the request goes on
unprocessed, and a route without the gateway's destination (metadata, or the header for
other paths) sends it to a round-robin fallback cluster. Every reply Envoy makes itself
(gateway down, timeouts, unreachable worker, limits) is rewritten into the gateway's
OpenAI-style JSON error body (:func:`_local_reply_config`).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

import orjson
import yaml

from cachepilot.core.flow.classify import header_names
from cachepilot.core.flow.config import FlowConfig
from cachepilot.core.request import INFERENCE_PATHS
from cachepilot.gateway.protocol import (
    BODY_METADATA,
    BODY_ONLY,
    BUFFERED_BODY,
    CHOSEN_KEY,
    DECISION_HEADER,
    DECISION_KEY,
    DESTINATION_HEADER,
    ERROR_HEADER,
    LB_METADATA_NAMESPACE,
    OBSERVE_METADATA,
    OBSERVE_ROLE,
    PATH_METADATA,
    ROLE_METADATA,
    ROUTE_ROLE,
    SERVED_KEY,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
    WORKER_HEADER,
    header_attribute,
)

_T = "type.googleapis.com/envoy."
# Headers the listener accepts beyond max_request_headers: what the gateway's mutations and
# Envoy itself add must never push a valid request over the codec's limit.
HEADER_HEADROOM = 16


@dataclass(frozen=True)
class EnvoyOptions:
    listen_address: str = "0.0.0.0"
    listen_port: int = 8080
    admin_address: str = "127.0.0.1"
    admin_port: int = 9901
    ext_proc_host: str = "127.0.0.1"
    ext_proc_port: int = 9002
    # More gateway replicas on the same host (cachepilot up --replicas): Envoy spreads the
    # ext_proc streams over all of them (round robin).
    ext_proc_more_ports: tuple[int, ...] = ()
    fail_open: bool = False
    fallback_workers: tuple[str, ...] = ()  # host:port; required with fail_open
    observe_responses: bool = True  # stream response bodies to the gateway (TTFT, cached tokens)
    # How the request body reaches the gateway: BUFFERED (the headers answered at once, the
    # whole body in one message whose answer routes) or STREAMED (every chunk at once, the
    # headers answered at the last one, then one answer per chunk).
    request_body_mode: str = "BUFFERED"
    # With a BUFFERED body, whether the routing stream also gets a headers message. Off (the
    # default): the body is its only message, one round trip each way: the route names the
    # path in the stream's metadata, a buffer filter holds the headers until the body is
    # routed, and the destination comes as envoy.lb metadata (a body answer cannot change
    # headers ext_proc never sent). On: the headers are answered at once, one more round trip
    # (STREAMED bodies always send them).
    send_request_headers: bool = False
    # Observe through a second ext_proc filter in observability mode: Envoy sends the response
    # to the gateway and never waits for it (off: the routing stream answers every response
    # message in turn, which the client waits for).
    observe_async: bool = True
    # The observing stream starts with the request headers (the decision id), so a request
    # whose client leaves before any answer is released at once. Off: it starts with the
    # response headers, one message less per request, and such a request is released only
    # after the gateway's GatewayOptions.unobserved_after_s.
    observe_request_headers: bool = True
    # How long Envoy keeps an observing stream open after its request has ended, for the
    # gateway to read what is queued on it (a burst can put it seconds behind); the gateway
    # ends the stream itself once it has seen the response's end.
    observe_close_timeout_s: float = 10.0
    max_body_bytes: int = 8 * 1024 * 1024
    upstream_timeout_s: float = 0.0  # 0: no limit (long generations stream)
    # Per try, until the worker's first byte; a response already flowing is never cut (Envoy
    # ignores a try's timeout once the downstream response has started). A non-streamed answer
    # starts when it is complete, so this must exceed the longest such generation. 0: none.
    first_byte_timeout_s: float = 60.0
    connect_timeout_s: float = 1.0
    # Tries beyond the first, each on the next worker of the gateway's list, for requests that
    # never reached a worker (refused or reset connection, refused stream).
    retries: int = 2
    # Workers known up front (host:port): the override-host cluster with a fallback list.
    workers: tuple[str, ...] = ()
    max_requests: int = 100_000  # circuit breakers: Envoy's default 1,024 caps load tests
    # Listener limits. A client has body_timeout_s to send its whole request (slowloris
    # bodies end in 408). With a STREAMED body the gateway answers the headers only once it
    # has the body, so the ext_proc message timeout covers the upload too and must outlast
    # body_timeout_s (BUFFERED: the body goes to the gateway once it is all in).
    headers_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 10_000
    # Client headers Envoy accepts; the listener allows this many more, room for what the
    # gateway and Envoy add (destination, decision id, x-request-id, x-forwarded-proto, …).
    max_request_headers: int = 100
    extra: dict[str, Any] = field(default_factory=dict)
    # Request headers flow control reads (tenant, priority band, TTFT target), forwarded to
    # the routing stream as ext_proc attributes: a body-only stream sees no headers.
    flow_headers: tuple[str, ...] = header_names(FlowConfig())

    @property
    def body_only(self) -> bool:
        """The routing stream carries the body alone (see ``send_request_headers``)."""
        return self.request_body_mode == "BUFFERED" and not self.send_request_headers

    @property
    def buffer_limit_bytes(self) -> int:
        """What Envoy buffers of a request body: the largest accepted body and then some, so
        the gateway, seeing more than max_body_bytes arrive, answers 413 in JSON before
        Envoy's own limit refuses it."""
        return self.max_body_bytes + 256 * 1024

    @property
    def message_timeout_ms(self) -> int:
        return int((self.body_timeout_s + 2.0) * 1000)

    def __post_init__(self) -> None:
        if self.request_body_mode not in ("BUFFERED", "STREAMED"):
            raise ValueError("request_body_mode is BUFFERED or STREAMED")
        if self.fail_open and not self.fallback_workers:
            raise ValueError("fail-open needs fallback workers (host:port) to send requests to")
        for hp in (*self.fallback_workers, *self.workers):
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
                        name: str, *, by_metadata: bool = False) -> list[dict[str, Any]]:
    """Fail-closed: one route to the workers (nothing named → 503). Fail-open: the gateway's
    destination (the header, or envoy.lb metadata ``by_metadata``) selects the workers'
    cluster; without it (gateway down) round-robin fallback."""
    # Who answered (a retry may have gone to the runner-up): the client and the gateway see it.
    answered = [{"header": {"key": WORKER_HEADER, "value": "%UPSTREAM_HOST%"},
                 "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]
    if not o.fail_open:
        return [{"name": name, "match": match, "route": to_workers,
                 "response_headers_to_add": answered}]
    picked = ({**match, "dynamic_metadata": [{
        "filter": LB_METADATA_NAMESPACE, "path": [{"key": DESTINATION_HEADER}],
        "value": {"present_match": True}}]} if by_metadata else
        {**match, "headers": [*match.get("headers", []),
                              {"name": DESTINATION_HEADER, "present_match": True}]})
    return [{"name": f"{name}-picked", "match": picked, "route": to_workers,
             "response_headers_to_add": answered},
            {"name": f"{name}-fallback", "match": match,
             "route": {**to_workers, "cluster": "cachepilot_fallback"},
             "response_headers_to_add": answered}]


def _error_body(status: int | str, message: str, kind: str) -> dict[str, Any]:
    """The gateway's OpenAI-style error envelope (cachepilot.core.request.RequestError)."""
    return {"error": {"message": message, "type": kind, "code": status}}


def _json_reply(status: int, message: str, kind: str = "invalid_request") -> dict[str, Any]:
    body = orjson.dumps(_error_body(status, message, kind)).decode()
    return {"status": status, "body": {"inline_string": body}}


def _cel(expression: str) -> dict[str, Any]:
    return {"extension_filter": {
        "name": "envoy.access_loggers.extension_filters.cel",
        "typed_config": {"@type": _T + "extensions.access_loggers.filters.cel.v3.ExpressionFilter",
                         "expression": expression}}}


def _flags(*flags: str) -> dict[str, Any]:
    return {"response_flag_filter": {"flags": list(flags)}}


def _mapper(match: dict[str, Any], status: int | None, message: str, kind: str,
            retry_after_s: int | None = None) -> dict[str, Any]:
    m: dict[str, Any] = {"filter": match, "body_format_override": {
        "json_format": _error_body(status or "%RESPONSE_CODE%", message, kind),
        "content_type": "application/json"}}
    if status is not None:
        m["status_code"] = status
    # The gateway sees this header on the response (a worker Envoy could not reach).
    headers = {ERROR_HEADER: kind}
    if retry_after_s is not None:
        headers["retry-after"] = str(retry_after_s)
    m["headers_to_add"] = [{"header": {"key": k, "value": v},
                            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
                           for k, v in headers.items()]
    return m


def _local_reply_config(o: EnvoyOptions) -> dict[str, Any]:
    """Envoy's own replies in the gateway's JSON error body, with a status that says what
    happened. The gateway's replies (ImmediateResponse, details ``cachepilot_*``) and the
    routes' direct JSON replies are left as they are. First match wins."""
    ttfb = f"{o.first_byte_timeout_s:g}s"
    return {"mappers": [
        # The processor unreachable, failed or too slow (fail-closed): nothing was routed.
        _mapper(_cel("response.code_details.startsWith('ext_proc')"), 503,
                "the routing gateway is unavailable; retry shortly",
                "gateway_unavailable", retry_after_s=1),
        # A chunked body past Envoy's buffer limit (a declared length is refused by the route).
        _mapper({"and_filter": {"filters": [
            {"status_code_filter": {"comparison": {"op": "EQ", "value": {
                "default_value": 413, "runtime_key": "cachepilot.body_too_large"}}}},
            _cel("!response.code_details.startsWith('cachepilot_')")]}},
            413, _too_large(o), "body_too_large"),
        _mapper(_flags("UT"), 504,
                f"worker %UPSTREAM_HOST% sent no first byte within {ttfb}", "worker_timeout"),
        _mapper(_flags("UO"), 503, "too many requests in flight; retry shortly", "overloaded",
                retry_after_s=1),
        _mapper(_flags("UF", "URX", "UH", "UR", "UC", "NR"), 503,
                "worker %UPSTREAM_HOST% is unreachable (%RESPONSE_CODE_DETAILS% "
                "%UPSTREAM_TRANSPORT_FAILURE_REASON%); retry shortly",
                "worker_unreachable", retry_after_s=1),
        # Anything else Envoy answers itself (header limits, request timeout, codec errors).
        _mapper(_cel("!(response.code_details.startsWith('cachepilot_') || "
                     "response.code_details == 'direct_response')"), None,
                "%LOCAL_REPLY_BODY% (%RESPONSE_CODE_DETAILS%)", "envoy_local_reply"),
    ]}


def _workers_cluster(o: EnvoyOptions) -> dict[str, Any]:
    """Known workers: override-host on the gateway's ordered list (metadata, else the header),
    walked on retries. Otherwise ORIGINAL_DST on the header: any ip:port, no fallback."""
    if not o.workers:
        return {"name": "cachepilot_workers", "type": "ORIGINAL_DST",
                "lb_policy": "CLUSTER_PROVIDED", "connect_timeout": f"{o.connect_timeout_s}s",
                # The chosen worker from a body-only answer's metadata, else the header
                # (a non-inference request, or a headers answer).
                "original_dst_lb_config": {
                    "use_http_header": True, "http_header_name": DESTINATION_HEADER,
                    "metadata_key": {"key": LB_METADATA_NAMESPACE,
                                     "path": [{"key": CHOSEN_KEY}]}},
                "cleanup_interval": "60s", "circuit_breakers": _breakers(o.max_requests)}
    cluster = _static_cluster("cachepilot_workers", [_split(h) for h in o.workers],
                              timeout_s=o.connect_timeout_s)
    del cluster["lb_policy"]
    cluster["load_balancing_policy"] = {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.override_host",
        "typed_config": {
            "@type": _T + "extensions.load_balancing_policies.override_host.v3.OverrideHost",
            "override_host_sources": [
                {"metadata": {"key": LB_METADATA_NAMESPACE,
                              "path": [{"key": DESTINATION_HEADER}]}},
                {"header": DESTINATION_HEADER}],
            # Unreached unless the gateway names no worker of this cluster.
            "fallback_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.round_robin",
                "typed_config": {"@type": _T + "extensions.load_balancing_policies.round_robin"
                                              ".v3.RoundRobin"}}}]}}}}]}
    cluster["circuit_breakers"] = _breakers(o.max_requests)
    return cluster


def _retry_policy(o: EnvoyOptions) -> dict[str, Any]:
    """Retry only what never reached a worker; a try that got no first byte in time ends in
    504 (a hung worker's request is not doubled onto another)."""
    policy: dict[str, Any] = {
        "retry_on": "connect-failure,refused-stream,reset-before-request",
        "num_retries": o.retries,
        "retry_back_off": {"base_interval": "0.005s", "max_interval": "0.05s"}}
    if o.first_byte_timeout_s > 0:
        policy["per_try_timeout"] = f"{o.first_byte_timeout_s}s"
    return policy


OBSERVE_FILTER = "cachepilot.observe"  # the second ext_proc filter's name


def _inference_routes(o: EnvoyOptions, path: str, to_workers: dict[str, Any]
                      ) -> list[dict[str, Any]]:
    """Inference routes stream the request to the gateway and, when ``observe_responses`` is
    on, show it the response: asynchronously through the observing filter (``observe_async``),
    else on the routing stream, answered message by message (the client waits for each)."""
    sync_observe = o.observe_responses and not o.observe_async
    routing: dict[str, Any] = {
        "processing_mode": {
            "request_header_mode": "SKIP" if o.body_only else "SEND",
            "request_body_mode": o.request_body_mode,
            "request_trailer_mode": "SKIP",
            "response_header_mode": "SEND" if sync_observe else "SKIP",
            "response_body_mode": "STREAMED" if sync_observe else "NONE",
            "response_trailer_mode": "SKIP"}}
    # The gateway learns from the stream how Envoy sends it the body and the response.
    observe = ("off" if not o.observe_responses else "sync" if sync_observe else "async")
    routing["grpc_initial_metadata"] = [{"key": OBSERVE_METADATA, "value": observe}]
    if o.body_only:
        routing["grpc_initial_metadata"] += [{"key": BODY_METADATA, "value": BODY_ONLY},
                                             {"key": PATH_METADATA, "value": path}]
    elif o.request_body_mode == "BUFFERED":
        routing["grpc_initial_metadata"].append({"key": BODY_METADATA, "value": BUFFERED_BODY})
    per_route: dict[str, Any] = {"envoy.filters.http.ext_proc": {
        "@type": _T + "extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
        "overrides": routing}}
    if o.observe_responses and o.observe_async:
        per_route[OBSERVE_FILTER] = {
            "@type": _T + "extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
            "overrides": {
                "processing_mode": {
                    "request_header_mode": "SEND" if o.observe_request_headers else "SKIP",
                    "request_body_mode": "NONE", "request_trailer_mode": "SKIP",
                    "response_header_mode": "SEND", "response_body_mode": "STREAMED",
                    "response_trailer_mode": "SKIP"},
                "grpc_initial_metadata": [{"key": ROLE_METADATA, "value": OBSERVE_ROLE}]}}
    post = {"path": path, "headers": [{"name": ":method", "string_match": {"exact": "POST"}}]}
    routes = [
        # No body means no ext_proc message at all: answer here.
        {"name": f"{path}-empty", "match": {**post, "headers": [
            *post["headers"], {"name": "content-length", "string_match": {"exact": "0"}}]},
         "direct_response": _json_reply(400, "request body is empty")},
        # A declared length over the limit never reaches the gateway (nor Envoy's buffer).
        {"name": f"{path}-too-large", "match": {**post, "headers": [
            *post["headers"], {"name": "content-length", "range_match": {
                "start": o.max_body_bytes + 1, "end": 1 << 62}}]},
         "direct_response": _json_reply(413, _too_large(o), "body_too_large")},
        {"name": f"{path}-method", "match": {"path": path, "headers": [
            {"name": ":method", "string_match": {"exact": "POST"}, "invert_match": True}]},
         "direct_response": _json_reply(405, f"{path} takes POST")},
    ]
    decision = (f"%DYNAMIC_METADATA({LB_METADATA_NAMESPACE}:{DECISION_KEY})%" if o.body_only
                else f"%REQ({DECISION_HEADER})%")
    for r in _picked_or_fallback(o, post, to_workers, path, by_metadata=o.body_only):
        r["typed_per_filter_config"] = per_route
        if o.body_only:  # the worker sees the gateway's choice in headers, as it always did
            r["request_headers_to_add"] = [
                {"header": {"key": k, "value": f"%DYNAMIC_METADATA({LB_METADATA_NAMESPACE}:{v})%"},
                 "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
                for k, v in ((DESTINATION_HEADER, CHOSEN_KEY), (DECISION_HEADER, DECISION_KEY))]
        if not sync_observe:  # the gateway answers no response message: Envoy adds it
            r["response_headers_to_add"] = [
                *r["response_headers_to_add"],
                {"header": {"key": DECISION_HEADER, "value": decision},
                 "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]
        routes.append(r)
    return routes


def _too_large(o: EnvoyOptions) -> str:
    return f"request body exceeds the limit of {o.max_body_bytes} bytes"


def _observe_filter(o: EnvoyOptions) -> dict[str, Any]:
    """The observing ext_proc filter: inference routes switch it on (``_inference_routes``);
    Envoy sends it the request headers (with the decision id) and the response, never waits
    for an answer, and a gateway that cannot be reached never fails a request."""
    return {
        "name": OBSERVE_FILTER,
        "typed_config": {
            "@type": _T + "extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "cachepilot_ext_proc"},
                             "timeout": "5s"},
            "stat_prefix": "observe",
            "observability_mode": True,
            "failure_mode_allow": True,
            # A body-only routing answer's decision id reaches the observing stream here.
            "metadata_options": {"forwarding_namespaces": {"untyped": [LB_METADATA_NAMESPACE]}},
            "deferred_close_timeout": f"{o.observe_close_timeout_s}s",
            "processing_mode": {
                "request_header_mode": "SKIP", "request_body_mode": "NONE",
                "request_trailer_mode": "SKIP", "response_header_mode": "SKIP",
                "response_body_mode": "NONE", "response_trailer_mode": "SKIP"},
        },
    }


def _hold_headers_filter(o: EnvoyOptions) -> dict[str, Any]:
    """Body-only routing: ext_proc passes the request headers on at once (it sends it none),
    so this buffer filter holds them, with the body, until the gateway's answer to the body
    has set the destination; the router then picks the worker from it. A request without a
    body passes straight through."""
    return {"name": "envoy.filters.http.buffer", "typed_config": {
        "@type": _T + "extensions.filters.http.buffer.v3.Buffer",
        "max_request_bytes": o.buffer_limit_bytes}}


def build_bootstrap(o: EnvoyOptions) -> dict[str, Any]:
    """The whole bootstrap as a dict (dump it as YAML or JSON)."""
    # Filter-wide mode serves non-inference paths (GET /v1/models, /health): headers only, and
    # the gateway names any ready worker. Inference routes override it (_inference_routes).
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _T + "extensions.filters.http.ext_proc.v3.ExternalProcessor",
            # Marks the streams as ours for a gateway in --protocol auto (the per-route
            # metadata of inference routes marks theirs too).
            "grpc_service": {"envoy_grpc": {"cluster_name": "cachepilot_ext_proc"},
                             "timeout": "5s",
                             "initial_metadata": [{"key": ROLE_METADATA, "value": ROUTE_ROLE}]},
            "failure_mode_allow": o.fail_open,
            "message_timeout": f"{o.message_timeout_ms / 1000:.3f}s",
            # The gateway's ordered worker list for the override-host cluster.
            "metadata_options": {"receiving_namespaces": {"untyped": [LB_METADATA_NAMESPACE]}},
            # Flow control's headers, in the stream's first message (a body-only stream gets
            # no headers). Filter-wide: Envoy 1.40 ignores a per-route request_attributes.
            **({"request_attributes": [header_attribute(h) for h in o.flow_headers]}
               if o.flow_headers else {}),
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
                  "idle_timeout": "300s", "retry_policy": _retry_policy(o)}
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
        "http_filters": [
            ext_proc,
            *([_hold_headers_filter(o)] if o.body_only else []),
            *([_observe_filter(o)] if o.observe_responses and o.observe_async else []),
            {"name": "envoy.filters.http.router", "typed_config": {
                "@type": _T + "extensions.filters.http.router.v3.Router"}}],
        "stream_idle_timeout": "300s",
        # Slow clients: the headers, then the whole request, must arrive in time (408).
        "request_headers_timeout": f"{o.headers_timeout_s}s",
        "request_timeout": f"{o.body_timeout_s}s",
        "common_http_protocol_options": {"max_headers_count": o.max_request_headers
                                         + HEADER_HEADROOM},
        "local_reply_config": _local_reply_config(o),
    }
    clusters = [
        _static_cluster("cachepilot_ext_proc",
                        [(o.ext_proc_host, p) for p in (o.ext_proc_port, *o.ext_proc_more_ports)],
                        http2=True),
        _workers_cluster(o),
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
                # Envoy holds a request body until the gateway has routed it.
                "per_connection_buffer_limit_bytes": o.buffer_limit_bytes,
                "filter_chains": [{"filters": [
                    {"name": "envoy.filters.network.connection_limit", "typed_config": {
                        "@type": _T + "extensions.filters.network.connection_limit.v3"
                                      ".ConnectionLimit",
                        "stat_prefix": "cachepilot", "max_connections": o.max_connections}},
                    {"name": "envoy.filters.network.http_connection_manager",
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


# -- Envoy in front of an endpoint picker, as the reference gateways configure it ------------
#
# Followed: gateway-api-inference-extension test/testdata/envoy.yaml and
# config/charts/standalone/values.yaml (at 1748e829, the last tree with the full EPP):
# one ext_proc filter sending request and response headers, FULL_DUPLEX_STREAMED bodies both
# ways and trailers (SEND), a 1000 s message timeout, no allow_mode_override, a gRPC health
# check of the EPP on "envoy.service.ext_proc.v3.ExternalProcessor", and an ORIGINAL_DST
# cluster on the x-gateway-destination-endpoint header. docs/epp.md explains the additions.

EPP_HEALTH_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


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
        for hp in (*self.fallback_workers, *self.workers):
            _split(hp)


def _epp_cluster(o: EppEnvoyOptions) -> dict[str, Any]:
    cluster = _static_cluster("epp", [(o.epp_host, o.epp_port)], http2=True)
    cluster["lb_policy"] = "LEAST_REQUEST"
    cluster["circuit_breakers"] = _breakers(o.max_requests)
    if o.health_check_interval_s > 0:
        cluster["health_checks"] = [{
            "timeout": "2s", "interval": f"{o.health_check_interval_s}s",
            "unhealthy_threshold": 3, "healthy_threshold": 2, "reuse_connection": True,
            "grpc_health_check": {"service_name": EPP_HEALTH_SERVICE}}]
    return cluster


def epp_workers_cluster(name: str, workers: tuple[str, ...], *, sources: tuple[str, ...] = (
        "metadata", "header"), max_requests: int = 40_000) -> dict[str, Any]:
    """Known workers behind Envoy's override-host load balancer, reading the EPP's choice
    from ``sources`` in order: ``envoy.lb`` metadata and/or the destination header. Without
    either, round robin (the fail-open path)."""
    cluster = _static_cluster(name, [_split(h) for h in workers])
    del cluster["lb_policy"]
    found = {"metadata": {"metadata": {"key": LB_METADATA_NAMESPACE,
                                       "path": [{"key": DESTINATION_HEADER}]}},
             "header": {"header": DESTINATION_HEADER}}
    cluster["load_balancing_policy"] = {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.override_host",
        "typed_config": {
            "@type": _T + "extensions.load_balancing_policies.override_host.v3.OverrideHost",
            "override_host_sources": [found[s] for s in sources],
            "fallback_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.round_robin",
                "typed_config": {"@type": _T + "extensions.load_balancing_policies.round_robin"
                                              ".v3.RoundRobin"}}}]}}}}]}
    cluster["circuit_breakers"] = _breakers(max_requests)
    return cluster


def epp_ext_proc_filter(o: EppEnvoyOptions) -> dict[str, Any]:
    """The ext_proc filter as the reference gateway configures it for an EPP."""
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _T + "extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s"},
            "failure_mode_allow": o.fail_open,
            "message_timeout": f"{o.message_timeout_s:g}s",
            "processing_mode": {
                "request_header_mode": "SEND", "response_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED",
                "response_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND", "response_trailer_mode": "SEND"},
            "metadata_options": {
                # The subset hint and the served endpoint go to the EPP; its envoy.lb answer
                # (the destination) is accepted for the override-host cluster.
                "forwarding_namespaces": {"untyped": [SUBSET_NAMESPACE, LB_METADATA_NAMESPACE]},
                "receiving_namespaces": {"untyped": [LB_METADATA_NAMESPACE]}},
        },
    }


def _header_to_metadata(rules_key: str, header: str, namespace: str, key: str
                        ) -> dict[str, Any]:
    return {"name": "envoy.filters.http.header_to_metadata", "typed_config": {
        "@type": _T + "extensions.filters.http.header_to_metadata.v3.Config",
        rules_key: [{"header": header, "remove": True, "on_header_present": {
            "metadata_namespace": namespace, "key": key, "type": "STRING"}}]}}


def epp_routes(o: EppEnvoyOptions, cluster: str, name: str = "inference"
               ) -> list[dict[str, Any]]:
    """Everything to the pool; fail-open: requests the EPP named no worker for (it was
    down) go round robin to the fallback cluster."""
    route: dict[str, Any] = {"cluster": cluster, "timeout": f"{o.route_timeout_s:g}s",
                             "idle_timeout": f"{o.route_timeout_s:g}s"}
    if o.retries:
        route["retry_policy"] = {"retry_on": "connect-failure,refused-stream,reset-before-request",
                                 "num_retries": o.retries}
    served = [{"header": {"key": SERVED_KEY, "value": "%UPSTREAM_HOST%"},
               "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}] if o.report_served else []
    base = {"match": {"prefix": "/"}, "route": route, "response_headers_to_add": served}
    if not o.fail_open or o.workers:  # override-host falls back on its own
        return [{"name": name, **base}]
    picked = {"prefix": "/", "headers": [{"name": DESTINATION_HEADER, "present_match": True}]}
    return [{"name": f"{name}-picked", **base, "match": picked},
            {"name": f"{name}-fallback", **base,
             "route": {**route, "cluster": "epp_fallback"}}]


def build_epp_bootstrap(o: EppEnvoyOptions) -> dict[str, Any]:
    """Envoy in front of an endpoint picker (docs/epp.md), as a dict."""
    workers = (epp_workers_cluster("inference_pool", o.workers, max_requests=o.max_requests)
               if o.workers else
               {"name": "inference_pool", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
                "connect_timeout": "5s", "circuit_breakers": _breakers(o.max_requests),
                "original_dst_lb_config": {"use_http_header": True,
                                           "http_header_name": DESTINATION_HEADER}})
    filters: list[dict[str, Any]] = []
    if o.subset_from_header:  # decoded before ext_proc: the EPP sees the hint
        filters.append(_header_to_metadata("request_rules", SUBSET_KEY, SUBSET_NAMESPACE,
                                           SUBSET_KEY))
    filters.append(epp_ext_proc_filter(o))
    if o.report_served:  # encoded before ext_proc: the EPP sees who served
        filters.append(_header_to_metadata("response_rules", SERVED_KEY, LB_METADATA_NAMESPACE,
                                           SERVED_KEY))
    filters.append({"name": "envoy.filters.http.router", "typed_config": {
        "@type": _T + "extensions.filters.http.router.v3.Router",
        "suppress_envoy_headers": True}})
    hcm = {
        "@type": _T + "extensions.filters.network.http_connection_manager.v3"
                      ".HttpConnectionManager",
        "stat_prefix": "epp_gateway",
        "codec_type": "AUTO",
        "generate_request_id": o.generate_request_id,
        # A client must not pick the upstream itself.
        "early_header_mutation_extensions": [{
            "name": "envoy.http.early_header_mutation.header_mutation",
            "typed_config": {
                "@type": _T + "extensions.http.early_header_mutation.header_mutation.v3"
                              ".HeaderMutation",
                "mutations": [{"remove": DESTINATION_HEADER}, {"remove": SERVED_KEY}]}}],
        "route_config": {"name": "inference", "virtual_hosts": [
            {"name": "inference", "domains": ["*"],
             "routes": epp_routes(o, "inference_pool")}]},
        "http_filters": filters,
    }
    clusters = [_epp_cluster(o), workers]
    if o.fail_open and not o.workers:
        fb = _static_cluster("epp_fallback", [_split(h) for h in o.fallback_workers])
        fb["circuit_breakers"] = _breakers(o.max_requests)
        clusters.append(fb)
    return {
        "admin": {"address": _addr(o.admin_address, o.admin_port)},
        "static_resources": {
            "listeners": [{
                "name": "epp_gateway",
                "address": _addr(o.listen_address, o.listen_port),
                "filter_chains": [{"filters": [
                    {"name": "envoy.filters.network.http_connection_manager",
                     "typed_config": hcm}]}],
            }],
            "clusters": clusters,
        },
        **o.extra,
    }


def render_epp(o: EppEnvoyOptions, fmt: str = "yaml") -> str:
    config = build_epp_bootstrap(o)
    if fmt == "json":
        return orjson.dumps(config, option=orjson.OPT_INDENT_2).decode()
    return yaml.safe_dump(config, sort_keys=False)
