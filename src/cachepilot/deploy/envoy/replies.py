"""The replies Envoy makes itself in our bootstrap (:mod:`cachepilot.deploy.envoy.ours`),
in the gateway's OpenAI-style JSON error body: the routes' direct responses
(:func:`json_reply`) and the local-reply mappers that rewrite everything else Envoy answers
(gateway down, timeouts, unreachable worker, limits: :func:`local_reply_config`), each with
``x-cachepilot-error`` naming the type. The error table (:mod:`cachepilot.gateway.errors`)
has a row for each.
"""

from __future__ import annotations

from typing import Any

import orjson

from cachepilot.deploy.envoy.common import T, header
from cachepilot.gateway.protocol import ERROR_HEADER


def error_body(status: int | str, message: str, kind: str) -> dict[str, Any]:
    """The gateway's OpenAI-style error envelope (cachepilot.core.request.RequestError)."""
    return {"error": {"message": message, "type": kind, "code": status}}


def json_reply(status: int, message: str, kind: str = "invalid_request") -> dict[str, Any]:
    body = orjson.dumps(error_body(status, message, kind)).decode()
    return {"status": status, "body": {"inline_string": body}}


def too_large(max_body_bytes: int) -> str:
    return f"request body exceeds the limit of {max_body_bytes} bytes"


def _cel(expression: str) -> dict[str, Any]:
    return {"extension_filter": {
        "name": "envoy.access_loggers.extension_filters.cel",
        "typed_config": {"@type": T + "extensions.access_loggers.filters.cel.v3.ExpressionFilter",
                         "expression": expression}}}


def _flags(*flags: str) -> dict[str, Any]:
    return {"response_flag_filter": {"flags": list(flags)}}


def _mapper(match: dict[str, Any], status: int | None, message: str, kind: str,
            retry_after_s: int | None = None) -> dict[str, Any]:
    m: dict[str, Any] = {"filter": match, "body_format_override": {
        "json_format": error_body(status or "%RESPONSE_CODE%", message, kind),
        "content_type": "application/json"}}
    if status is not None:
        m["status_code"] = status
    # The gateway sees this header on the response (a worker Envoy could not reach).
    headers = {ERROR_HEADER: kind}
    if retry_after_s is not None:
        headers["retry-after"] = str(retry_after_s)
    m["headers_to_add"] = [header(k, v) for k, v in headers.items()]
    return m


def local_reply_config(max_body_bytes: int, first_byte_timeout_s: float) -> dict[str, Any]:
    """Envoy's own replies in the gateway's JSON error body, with a status that says what
    happened. The gateway's replies (ImmediateResponse, details ``cachepilot_*``) and the
    routes' direct JSON replies are left as they are. First match wins."""
    ttfb = f"{first_byte_timeout_s:g}s"
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
            413, too_large(max_body_bytes), "body_too_large"),
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
