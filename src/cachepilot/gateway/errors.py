"""Every error a client can get back instead of a worker's answer: the one table the docs'
reference (``cachepilot.docgen``) and troubleshooting pages are generated from.

Two components answer errors. The gateway answers through ext_proc (an ImmediateResponse:
Envoy never contacts a worker); Envoy answers itself from the bootstrap the gateway's code
generates (:mod:`cachepilot.deploy.envoy.ours`, its replies in
:mod:`cachepilot.deploy.envoy.replies`: direct responses and local-reply mappers, which also
set ``x-cachepilot-error`` to the type). Both send OpenAI's error envelope,
``{"error": {"message": …, "type": …, "code": <status>}}``, so an unmodified client shows the
message. ``tests/gateway/test_error_table.py`` keeps this table and the code in step both ways:
every ``RequestError`` the core and the gateway raise, and every reply in the generated Envoy
bootstrap, has its row here, and every row is still produced somewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from cachepilot.core.flow.config import FlowConfig

GATEWAY = "gateway"  # the ext_proc service's ImmediateResponse
ENVOY = "envoy"  # Envoy's direct response or local reply, from the generated bootstrap


@dataclass(frozen=True, slots=True)
class ErrorAnswer:
    """One kind of error answer: its status, the ``error.type`` in its body, who answers it."""

    status: int | None  # None: Envoy's own status (408, 431, …), passed through
    type: str  # error.type in the body (and x-cachepilot-error on Envoy's replies)
    source: str  # GATEWAY or ENVOY
    retry_after: bool  # a Retry-After header comes with it
    when: str
    action: str  # what the client or operator does about it


ERRORS: tuple[ErrorAnswer, ...] = (
    ErrorAnswer(400, "invalid_request", GATEWAY, False,
                "The body is not valid JSON or not an object (endpoint picker protocol "
                "only: behind the gateway's own Envoy config such a body is routed by load "
                "and the engine answers it), `model` is missing or empty, `prompt` or "
                "`messages` is missing or of the wrong type, `stream` is not a boolean, "
                "`max_tokens` is negative, or the body is empty.",
                "Fix the request; the message names the field."),
    ErrorAnswer(404, "model_not_found", GATEWAY, False,
                "No pool serves the body's `model` (and no pool serves every model).",
                "Use one of the models the message lists, or add it to a pool's `models` "
                "(CachePilotPool `spec.models`, `cachepilot gateway --model`)."),
    ErrorAnswer(404, "invalid_request", GATEWAY, False,
                "A body reached the gateway for a path that is not `/v1/completions` or "
                "`/v1/chat/completions` (the shipped Envoy configs never send one).",
                "Check the proxy's routes: only the inference paths go to the gateway."),
    ErrorAnswer(413, "body_too_large", GATEWAY, False,
                "The body (declared or as it arrives) is larger than `--max-body-bytes` "
                "(8 MiB by default).",
                "Send a smaller body or raise `--max-body-bytes` (and Envoy's limit, which "
                "`cachepilot envoy-config --max-body-bytes` sets to match)."),
    ErrorAnswer(429, "overloaded", GATEWAY, True,
                "Every worker of the pool is at its admission limit (`admissionLimit` "
                "requests waiting) or has no fresh metrics (none within the stale limit, "
                "5 s by default).",
                "Retry after `Retry-After` seconds. If it persists, add workers or check "
                "that the gateway can scrape them (see Troubleshooting: stale metrics)."),
    ErrorAnswer(503, "no_healthy_worker", GATEWAY, True,
                "The pool has no ready worker (the message names those that are down and "
                "why), or none of the workers in the proxy's subset hint is eligible.",
                "Retry after `Retry-After` seconds; check the workers (`GET /workers` on "
                "the admin port, the CachePilotPool's status)."),
    # Flow control's refusals (cachepilot.core.flow.refusal): x-cachepilot-shed-reason says
    # the reason; the type is flow_<reason>.
    ErrorAnswer(429, "flow_queue_full", GATEWAY, True,
                "Flow control's queue for the request's priority band is full "
                "(`max_queued`) and the request's tenant already holds the most of it.",
                "Retry after `Retry-After` seconds; a tenant that floods is the one refused. "
                "Raise `max_queued` or add workers if every tenant meets it."),
    ErrorAnswer(429, "flow_tenant_over_share", GATEWAY, True,
                "A held request pushed out of its band's full queue by a newcomer: its "
                "tenant held the most of the queue.",
                "As `flow_queue_full`."),
    ErrorAnswer(429, "flow_ttl_expired", GATEWAY, True,
                f"Held for its band's time to live (`ttl_s`, {FlowConfig().ttl_s:g} s by default) "
                "and no worker opened for it.",
                "Retry after `Retry-After` seconds; the pool is saturated: add workers, or "
                "lower this traffic's band."),
    ErrorAnswer(429, "flow_sheddable", GATEWAY, True,
                "A sheddable request (negative priority) that would have had to wait: shed "
                "before any other band's request.",
                "Retry later, or send it in a band of priority 0 or more."),
    ErrorAnswer(429, "flow_slo_unmeetable", GATEWAY, True,
                "A sheddable request with a TTFT target no worker is predicted to meet.",
                "Retry later, or relax the target header."),
    ErrorAnswer(503, "flow_no_ready_worker", GATEWAY, True,
                "A held request's pool lost its last ready worker.",
                "As `no_healthy_worker`."),
    ErrorAnswer(500, "internal_error", GATEWAY, False,
                "A bug in the gateway while routing this request; it keeps serving others.",
                "Retry; report it with the gateway's log line."),
    ErrorAnswer(500, "proxy_config", GATEWAY, False,
                "Envoy sent a body-only routing stream whose route names no inference path: "
                "its config is not the one the gateway generates.",
                "Regenerate Envoy's bootstrap with `cachepilot envoy-config`."),
    ErrorAnswer(400, "invalid_request", ENVOY, False,
                "A POST to an inference path with `content-length: 0`.",
                "Send a body."),
    ErrorAnswer(405, "invalid_request", ENVOY, False,
                "An inference path called with another method than POST.",
                "Use POST."),
    ErrorAnswer(413, "body_too_large", ENVOY, False,
                "A declared `content-length`, or a chunked body, over the limit.",
                "As the gateway's 413."),
    ErrorAnswer(503, "gateway_unavailable", ENVOY, True,
                "Fail-closed (the default): the gateway is unreachable, failed or too slow, "
                "so nothing was routed.",
                "Retry; check the gateway process or pod. A fail-open bootstrap "
                "(`cachepilot envoy-config --fail-open --fallback …`) sends requests round "
                "robin instead."),
    ErrorAnswer(503, "overloaded", ENVOY, True,
                "Envoy's circuit breaker: too many requests in flight to the workers.",
                "Retry. The limit is the bootstrap's circuit breaker (`max_requests`, "
                "100,000 in the generated config)."),
    ErrorAnswer(503, "worker_unreachable", ENVOY, True,
                "Envoy could not connect to the chosen worker, nor to the runner-ups it "
                "retried. The gateway marks the worker down until a scrape finds it back.",
                "Retry; the next request goes elsewhere."),
    ErrorAnswer(504, "worker_timeout", ENVOY, False,
                "The worker sent no first byte within the first-byte timeout (60 s by "
                "default; `cachepilot up --first-byte-timeout`). A stream is never cut once "
                "it flows.",
                "Check the worker (hung, or a very long prefill); raise the timeout for "
                "very long prompts."),
    ErrorAnswer(None, "envoy_local_reply", ENVOY, False,
                "Anything else Envoy answers itself, with its own status: a request whose "
                "headers or body arrived too slowly (408), header limits, codec errors.",
                "The message carries Envoy's details; fix the client or raise the limit."),
)


def by_source(source: str) -> tuple[ErrorAnswer, ...]:
    return tuple(e for e in ERRORS if e.source == source)
