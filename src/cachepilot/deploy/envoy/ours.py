"""Our Envoy bootstrap: Envoy in front of CachePilot's own ext_proc protocol. The local
stacks, the tests, the Helm chart and ``extproc/envoy.yaml`` all use it
(:func:`cachepilot.deploy.envoy.render`).

Requests pass the ext_proc filter (CachePilot picks a worker and names its ``ip:port`` in
``envoy.lb`` metadata), then the workers' cluster connects to that address. Envoy buffers the
body and sends it whole as the routing stream's only message (no headers message: a buffer
filter holds the headers meanwhile); the answer carries the fallback list, the chosen worker
and the decision id, one round trip each way (``send_request_headers`` adds the headers
message back, answered at once, and the destination header). A second ext_proc filter in
``observability_mode`` shows the gateway the request's decision id and the response (status,
first byte and token) without Envoy ever waiting for it; the gateway closes that stream at
the first token, and Envoy's access log reports the response's end, with the usage a Lua
filter read from it (:mod:`cachepilot.deploy.envoy.usage`). Bodies over
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
OpenAI-style JSON error body (:func:`cachepilot.deploy.envoy.replies.local_reply_config`).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from cachepilot.core.flow.classify import header_names
from cachepilot.core.flow.config import FlowConfig
from cachepilot.core.request import INFERENCE_PATHS
from cachepilot.deploy.envoy.common import (
    EXT_PROC_FILTER,
    T,
    bootstrap,
    breakers,
    check_hostports,
    ext_proc_filter,
    fallback_cluster,
    header,
    http_connection_manager,
    lb_matcher,
    original_dst_cluster,
    override_host_cluster,
    picked_or_fallback,
    processing_mode,
    router_filter,
    static_cluster,
)
from cachepilot.deploy.envoy.replies import json_reply, local_reply_config, too_large
from cachepilot.deploy.envoy.usage import access_logs, usage_filter
from cachepilot.gateway.protocol import (
    BODY_METADATA,
    BODY_ONLY,
    BUFFERED_BODY,
    CHOSEN_KEY,
    DECISION_HEADER,
    DECISION_KEY,
    DESTINATION_HEADER,
    FIRST_TOKEN,
    LB_METADATA_NAMESPACE,
    OBSERVE_METADATA,
    OBSERVE_ROLE,
    PATH_METADATA,
    PROCESS_ID_PREFIX,
    ROLE_METADATA,
    ROUTE_ROLE,
    UNOBSERVED_KEY,
    WORKER_HEADER,
    header_attribute,
)

# Headers the listener accepts beyond max_request_headers: what the gateway's mutations and
# Envoy itself add must never push a valid request over the codec's limit.
HEADER_HEADROOM = 16
OBSERVE_FILTER = "cachepilot.observe"  # the second ext_proc filter's name
EXT_PROC_CLUSTER = "cachepilot_ext_proc"
# The access log's own connection to the gateway: on the routing streams' connection, long
# bodies filled its write buffer under load, and Envoy drops a log entry whose stream is
# above its buffer's high watermark (grpc_entries_flush_failed: 1,147 in 8 s of 150
# concurrent 220 KB requests, and requests left booked; none on a connection of its own).
ACCESS_LOG_CLUSTER = "cachepilot_access_log"
# Room for a burst of entries (~1 KB each) while the gateway is busy.
ACCESS_LOG_BUFFER_BYTES = 16 << 20
WORKERS_CLUSTER = "cachepilot_workers"
FALLBACK_CLUSTER = "cachepilot_fallback"


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
    # One gateway run with ``--processes N`` (cachepilot.gateway.processes): process i has
    # ext_proc_port + 1 + i to itself. Routing streams go round robin over those; a
    # request's observing stream goes to the process that routed it (its decision id says
    # which, :func:`process_routes`).
    ext_proc_processes: int = 1
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
    # The gateway closes the observing stream at the first token; Envoy's access log
    # (cachepilot.deploy.envoy.usage) reports the end, the status and the usage a Lua filter
    # reads from the answer's end. A handful of messages per request however long the answer,
    # where reading it all costs the gateway ~40 µs per streamed event. Off: the observing
    # stream reads the whole response.
    observe_until_first_token: bool = True
    # Envoy's access log sends the entries of this many ms together, one gRPC message (a
    # message costs the gateway a wake-up and ~40 µs, more than an entry). The worker is
    # freed when Envoy ends the request (the routing stream's close); the entry, up to this
    # much later, brings the outcome with Envoy's own times. 0: each at once.
    access_log_flush_ms: int = 10
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
    # Requests Envoy sends on one connection to a worker; 0: no limit. 1 for llama.cpp
    # workers, which close the connection after every streamed answer although they
    # advertise keep-alive (common.worker_connections).
    worker_requests_per_connection: int = 0
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
        if self.access_log_flush_ms < 0:
            raise ValueError("access_log_flush_ms is 0 (each entry at once) or more")
        if self.request_body_mode not in ("BUFFERED", "STREAMED"):
            raise ValueError("request_body_mode is BUFFERED or STREAMED")
        if self.fail_open and not self.fallback_workers:
            raise ValueError("fail-open needs fallback workers (host:port) to send requests to")
        check_hostports(*self.fallback_workers, *self.workers)
        if self.ext_proc_processes < 1 or (self.ext_proc_processes > 1
                                           and self.ext_proc_more_ports):
            raise ValueError("ext_proc_processes is 1 or more, and excludes more ports")
        if self.ext_proc_more_ports and self.observe_responses and self.observe_async:
            # Envoy balances the observing stream and the access log on their own: they may
            # reach a replica that did not route the request.
            raise ValueError("several gateway replicas behind one Envoy observe responses on "
                             "the routing stream (observe_async=False)")
        if self.worker_requests_per_connection < 0:
            raise ValueError("worker_requests_per_connection is 0 (no limit) or more")


def _workers_cluster(o: EnvoyOptions) -> dict[str, Any]:
    """Known workers: override-host on the gateway's ordered list (metadata, else the header),
    walked on retries. Otherwise ORIGINAL_DST: the chosen worker from a body-only answer's
    metadata, else the header (a non-inference request, or a headers answer)."""
    if o.workers:
        return override_host_cluster(
            WORKERS_CLUSTER, o.workers, timeout_s=o.connect_timeout_s,
            max_requests=o.max_requests, requests_per_connection=o.worker_requests_per_connection)
    return original_dst_cluster(WORKERS_CLUSTER, timeout_s=o.connect_timeout_s,
                                max_requests=o.max_requests, metadata_key=CHOSEN_KEY,
                                requests_per_connection=o.worker_requests_per_connection,
                                cleanup_interval="60s")


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


def _routes(o: EnvoyOptions, name: str, match: dict[str, Any], route: dict[str, Any],
            *, by_metadata: bool = False) -> list[dict[str, Any]]:
    """To the workers, or fail-open's pair; who answered (a retry may have gone to the
    runner-up) is named to the client and the gateway."""
    answered = [header(WORKER_HEADER, "%UPSTREAM_HOST%")]
    return picked_or_fallback(name, match, route, answered, split_routes=o.fail_open,
                              fallback=FALLBACK_CLUSTER, by_metadata=by_metadata)


def _inference_routes(o: EnvoyOptions, path: str, to_workers: dict[str, Any]
                      ) -> list[dict[str, Any]]:
    """Inference routes stream the request to the gateway and, when ``observe_responses`` is
    on, show it the response: asynchronously through the observing filter (``observe_async``),
    else on the routing stream, answered message by message (the client waits for each)."""
    sync_observe = o.observe_responses and not o.observe_async
    routing: dict[str, Any] = {"processing_mode": processing_mode(
        request_header="SKIP" if o.body_only else "SEND",
        request_body=o.request_body_mode,
        response_header="SEND" if sync_observe else "SKIP",
        response_body="STREAMED" if sync_observe else "NONE")}
    # The gateway learns from the stream how Envoy sends it the body and the response.
    observe = ("off" if not o.observe_responses else "sync" if sync_observe else
               FIRST_TOKEN if o.observe_until_first_token else "async")
    routing["grpc_initial_metadata"] = [{"key": OBSERVE_METADATA, "value": observe}]
    if o.body_only:
        routing["grpc_initial_metadata"] += [{"key": BODY_METADATA, "value": BODY_ONLY},
                                             {"key": PATH_METADATA, "value": path}]
    elif o.request_body_mode == "BUFFERED":
        routing["grpc_initial_metadata"].append({"key": BODY_METADATA, "value": BUFFERED_BODY})
    per_route: dict[str, Any] = {EXT_PROC_FILTER: {
        "@type": T + "extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
        "overrides": routing}}
    if o.observe_responses and o.observe_async:
        per_route[OBSERVE_FILTER] = {
            "@type": T + "extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
            "overrides": {
                "processing_mode": processing_mode(
                    request_header="SEND" if o.observe_request_headers else "SKIP",
                    response_header="SEND", response_body="STREAMED"),
                "grpc_initial_metadata": [{"key": ROLE_METADATA, "value": OBSERVE_ROLE},
                                          {"key": OBSERVE_METADATA, "value": observe}]}}
    post = {"path": path, "headers": [{"name": ":method", "string_match": {"exact": "POST"}}]}
    routes = [
        # No body means no ext_proc message at all: answer here.
        {"name": f"{path}-empty", "match": {**post, "headers": [
            *post["headers"], {"name": "content-length", "string_match": {"exact": "0"}}]},
         "direct_response": json_reply(400, "request body is empty")},
        # A declared length over the limit never reaches the gateway (nor Envoy's buffer).
        {"name": f"{path}-too-large", "match": {**post, "headers": [
            *post["headers"], {"name": "content-length", "range_match": {
                "start": o.max_body_bytes + 1, "end": 1 << 62}}]},
         "direct_response": json_reply(413, too_large(o.max_body_bytes), "body_too_large")},
        {"name": f"{path}-method", "match": {"path": path, "headers": [
            {"name": ":method", "string_match": {"exact": "POST"}, "invert_match": True}]},
         "direct_response": json_reply(405, f"{path} takes POST")},
    ]
    decision = (f"%DYNAMIC_METADATA({LB_METADATA_NAMESPACE}:{DECISION_KEY})%" if o.body_only
                else f"%REQ({DECISION_HEADER})%")
    for r in _routes(o, path, post, to_workers, by_metadata=o.body_only):
        r["typed_per_filter_config"] = per_route
        if o.body_only:  # the worker sees the gateway's choice in headers, as it always did
            r["request_headers_to_add"] = [
                header(k, f"%DYNAMIC_METADATA({LB_METADATA_NAMESPACE}:{v})%")
                for k, v in ((DESTINATION_HEADER, CHOSEN_KEY), (DECISION_HEADER, DECISION_KEY))]
        if not sync_observe:  # the gateway answers no response message: Envoy adds it
            r["response_headers_to_add"] = [*r["response_headers_to_add"],
                                            header(DECISION_HEADER, decision)]
        if _observes_until_first_token(o) and o.body_only:
            routes.append(unobserved_route(r))
        if o.ext_proc_processes > 1 and OBSERVE_FILTER in per_route:
            routes += process_routes(r, o.ext_proc_processes, by_metadata=o.body_only)
        routes.append(r)
    return routes


def unobserved_route(route: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``route`` for the requests the routing answer marks unobserved (not
    streamed: Envoy's access log alone reports them), with the observing filter off: no
    second gRPC stream for them. Envoy matches it once the routing answer clears the route
    cache."""
    match = copy.deepcopy(route["match"])
    match["dynamic_metadata"] = [*match.get("dynamic_metadata", []),
                                 lb_matcher(UNOBSERVED_KEY, {"string_match": {"exact": "1"}})]
    per_route = {**copy.deepcopy(route["typed_per_filter_config"]), OBSERVE_FILTER: {
        "@type": T + "extensions.filters.http.ext_proc.v3.ExtProcPerRoute", "disabled": True}}
    return _variant(route, "unobserved", match, per_route)


def _variant(route: dict[str, Any], suffix: str, match: dict[str, Any],
             per_route: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``route`` named ``<name>-<suffix>`` with its own match and per-filter
    config."""
    return {**copy.deepcopy(route), "name": f"{route['name']}-{suffix}", "match": match,
            "typed_per_filter_config": per_route}


def process_routes(route: dict[str, Any], processes: int, *, by_metadata: bool
                   ) -> list[dict[str, Any]]:
    """One copy of ``route`` per gateway process, matched on the routing answer's decision
    id (process i's ids start ``p<i>.``, :func:`cachepilot.gateway.processes.id_prefix`),
    whose observing filter calls that process's own cluster: the process that routed a
    request is the one holding its exchange. ``route`` itself stays last, for requests no
    process routed (fail-open)."""
    out = []
    for i in range(processes):
        match = copy.deepcopy(route["match"])
        prefix = {"prefix": f"{PROCESS_ID_PREFIX}{i}."}
        if by_metadata:
            match["dynamic_metadata"] = [*match.get("dynamic_metadata", []),
                                         lb_matcher(DECISION_KEY, {"string_match": prefix})]
        else:
            match["headers"] = [*match.get("headers", []),
                                {"name": DECISION_HEADER, "string_match": prefix}]
        per_route = copy.deepcopy(route["typed_per_filter_config"])
        per_route[OBSERVE_FILTER]["overrides"]["grpc_service"] = {
            "envoy_grpc": {"cluster_name": process_cluster(i)}, "timeout": "5s"}
        out.append(_variant(route, f"p{i}", match, per_route))
    return out


def access_log_cluster(i: int) -> str:
    """The cluster of gateway process ``i``'s access log stream (its own connection)."""
    return f"{ACCESS_LOG_CLUSTER}_p{i}"


def process_cluster(i: int) -> str:
    """The ext_proc cluster of gateway process ``i`` alone (observing streams)."""
    return f"{EXT_PROC_CLUSTER}_p{i}"


def _routing_filter(o: EnvoyOptions) -> dict[str, Any]:
    """The routing ext_proc filter. Its filter-wide mode serves non-inference paths (GET
    /v1/models, /health): headers only, and the gateway names any ready worker. Inference
    routes override it (:func:`_inference_routes`)."""
    return ext_proc_filter(
        EXT_PROC_CLUSTER, mode=processing_mode(request_header="SEND"), timeout_s=5.0,
        # Marks the streams as ours for a gateway in --protocol auto (the per-route
        # metadata of inference routes marks theirs too).
        initial_metadata=[(ROLE_METADATA, ROUTE_ROLE)],
        failure_mode_allow=o.fail_open,
        message_timeout=f"{o.message_timeout_ms / 1000:.3f}s",
        # The gateway's ordered worker list for the override-host cluster.
        metadata_options={"receiving_namespaces": {"untyped": [LB_METADATA_NAMESPACE]}},
        # Flow control's headers, in the stream's first message (a body-only stream gets
        # no headers). Filter-wide: Envoy 1.40 ignores a per-route request_attributes.
        **({"request_attributes": [header_attribute(h) for h in o.flow_headers]}
           if o.flow_headers else {}),
        # Stream the body at once: the gateway answers the headers when it has the body,
        # so a decision costs one round trip (STREAMED mode only).
        send_body_without_waiting_for_header_response=True)


def _observe_filter(o: EnvoyOptions) -> dict[str, Any]:
    """The observing ext_proc filter: inference routes switch it on (``_inference_routes``);
    Envoy sends it the request headers (with the decision id) and the response, never waits
    for an answer, and a gateway that cannot be reached never fails a request."""
    return ext_proc_filter(
        EXT_PROC_CLUSTER, name=OBSERVE_FILTER, mode=processing_mode(), timeout_s=5.0,
        stat_prefix="observe", observability_mode=True, failure_mode_allow=True,
        # A body-only routing answer's decision id reaches the observing stream here.
        metadata_options={"forwarding_namespaces": {"untyped": [LB_METADATA_NAMESPACE]}},
        deferred_close_timeout=f"{o.observe_close_timeout_s}s")


def _observes_until_first_token(o: EnvoyOptions) -> bool:
    return o.observe_responses and o.observe_async and o.observe_until_first_token


def _hold_headers_filter(o: EnvoyOptions) -> dict[str, Any]:
    """Body-only routing: ext_proc passes the request headers on at once (it sends it none),
    so this buffer filter holds them, with the body, until the gateway's answer to the body
    has set the destination; the router then picks the worker from it. A request without a
    body passes straight through."""
    return {"name": "envoy.filters.http.buffer", "typed_config": {
        "@type": T + "extensions.filters.http.buffer.v3.Buffer",
        "max_request_bytes": o.buffer_limit_bytes}}


def build(o: EnvoyOptions) -> dict[str, Any]:
    """The whole bootstrap as a dict (dump it with :func:`cachepilot.deploy.envoy.render`)."""
    to_workers = {"cluster": WORKERS_CLUSTER, "timeout": f"{o.upstream_timeout_s}s",
                  "idle_timeout": "300s", "retry_policy": _retry_policy(o)}
    routes: list[dict[str, Any]] = []
    for path in INFERENCE_PATHS:
        routes += _inference_routes(o, path, to_workers)
    routes += _routes(o, "other", {"prefix": "/"}, to_workers)
    until_first_token = _observes_until_first_token(o)
    logs = (access_logs([access_log_cluster(i) for i in range(o.ext_proc_processes)],
                        by_metadata=o.body_only, flush_ms=o.access_log_flush_ms)
            if until_first_token else [])
    hcm = http_connection_manager(
        "cachepilot", remove_headers=(DESTINATION_HEADER,), route_config_name="cachepilot",
        routes=routes,
        filters=[_routing_filter(o),
                 *([_hold_headers_filter(o)] if o.body_only else []),
                 *([_observe_filter(o)] if o.observe_responses and o.observe_async else []),
                 *([usage_filter()] if until_first_token else []),
                 router_filter()],
        **({"access_log": logs} if logs else {}),
        stream_idle_timeout="300s",
        # Slow clients: the headers, then the whole request, must arrive in time (408).
        request_headers_timeout=f"{o.headers_timeout_s}s",
        request_timeout=f"{o.body_timeout_s}s",
        common_http_protocol_options={"max_headers_count": o.max_request_headers
                                      + HEADER_HEADROOM},
        local_reply_config=local_reply_config(o.max_body_bytes, o.first_byte_timeout_s))
    ports = ((o.ext_proc_port, *o.ext_proc_more_ports) if o.ext_proc_processes == 1 else
             tuple(o.ext_proc_port + 1 + i for i in range(o.ext_proc_processes)))
    ext_proc = static_cluster(EXT_PROC_CLUSTER, [(o.ext_proc_host, p) for p in ports],
                              http2=True)
    ext_proc["circuit_breakers"] = breakers(o.max_requests)
    clusters = [ext_proc, _workers_cluster(o)]
    if o.ext_proc_processes > 1:
        for i in range(o.ext_proc_processes):
            one = static_cluster(process_cluster(i),
                                 [(o.ext_proc_host, o.ext_proc_port + 1 + i)], http2=True)
            one["circuit_breakers"] = breakers(o.max_requests)
            clusters.append(one)
    if until_first_token:
        for i in range(o.ext_proc_processes):
            log = static_cluster(access_log_cluster(i), [(o.ext_proc_host, p) for p in (
                ports if o.ext_proc_processes == 1 else (ports[i],))], http2=True)
            log["per_connection_buffer_limit_bytes"] = ACCESS_LOG_BUFFER_BYTES
            clusters.append(log)
    if o.fail_open:
        clusters.append(fallback_cluster(
            FALLBACK_CLUSTER, o.fallback_workers, o.max_requests, timeout_s=o.connect_timeout_s,
            requests_per_connection=o.worker_requests_per_connection))
    return bootstrap(
        admin=(o.admin_address, o.admin_port), listener="cachepilot",
        listen=(o.listen_address, o.listen_port), hcm=hcm, clusters=clusters,
        # Envoy holds a request body until the gateway has routed it.
        listener_fields={"per_connection_buffer_limit_bytes": o.buffer_limit_bytes},
        network_filters=({"name": "envoy.filters.network.connection_limit", "typed_config": {
            "@type": T + "extensions.filters.network.connection_limit.v3.ConnectionLimit",
            "stat_prefix": "cachepilot", "max_connections": o.max_connections}},),
        extra=o.extra)
