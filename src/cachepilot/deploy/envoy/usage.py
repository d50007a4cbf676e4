"""Observing until the first token: what Envoy adds so the gateway still learns a response's
end and usage without reading every event of a streamed answer.

- A Lua filter, next to the router, keeps the last bytes of each response body as it streams
  by (it never buffers the body) and at its end puts the worker's usage in dynamic metadata
  (``USAGE_NAMESPACE``): the last ``"cached_tokens": N`` (else llama.cpp's ``"cache_n"``)
  and ``"completion_tokens": N`` (else ``"predicted_n"``), as the gateway's own reading of a
  body does (``cachepilot.gateway.director``).
- Envoy's gRPC access log sends each routed request's entry to the gateway at its end (one
  long-lived stream, an entry as soon as it is written: the end releases the worker's
  booking). The entry carries the dynamic metadata (the decision id in ``envoy.lb``, the
  usage), the status, the worker and Envoy's response flags. With several gateway processes,
  each gets the entries of the requests it routed (the decision id's prefix).
"""

from __future__ import annotations

from typing import Any

from cachepilot.deploy.envoy.common import T
from cachepilot.gateway.protocol import (
    DECISION_HEADER,
    DECISION_KEY,
    ERROR_HEADER,
    LB_METADATA_NAMESPACE,
    PROCESS_ID_PREFIX,
    USAGE_NAMESPACE,
)

# Bytes kept of each chunk's end: the usage object is in the last event or two.
LUA_USAGE = f"""
local TAIL = 1024
local function last(text, key)
  local found = nil
  for v in string.gmatch(text, '"' .. key .. '"%s*:%s*(%d+)') do found = v end
  return found
end
function envoy_on_response(handle)
  -- The last two chunks' ends, joined once: a string rebuilt per chunk made Envoy's
  -- CPU grow with the answer's length. (`final`, not `last`: that is the function.)
  local prev, final = "", ""
  for chunk in handle:bodyChunks() do
    local n = chunk:length()
    if n > 0 then
      local k = math.min(n, TAIL)
      prev, final = final, chunk:getBytes(n - k, k)
    end
  end
  local tail = prev .. final
  local cached = last(tail, "cached_tokens") or last(tail, "cache_n")
  local completion = last(tail, "completion_tokens") or last(tail, "predicted_n")
  local meta = handle:streamInfo():dynamicMetadata()
  if cached then meta:set("{USAGE_NAMESPACE}", "cached_tokens", tonumber(cached)) end
  if completion then meta:set("{USAGE_NAMESPACE}", "completion_tokens", tonumber(completion)) end
end
"""


def usage_filter() -> dict[str, Any]:
    """The Lua filter reading the usage at a response's end (placed just before the router,
    so the response passes it first)."""
    return {"name": "envoy.filters.http.lua", "typed_config": {
        "@type": T + "extensions.filters.http.lua.v3.Lua",
        "default_source_code": {"inline_string": LUA_USAGE}}}


def access_logs(clusters: list[str], *, by_metadata: bool, flush_ms: int
                ) -> list[dict[str, Any]]:
    """One gRPC access logger per gateway process (``clusters[i]``: process i's; one cluster:
    every routed request), logging the requests that gateway routed: those with a decision id
    (in ``envoy.lb`` metadata when ``by_metadata``, the body-only routing answer's, else in
    the request headers), of process i's prefix when there are several."""
    out = []
    for i, cluster in enumerate(clusters):
        several = len(clusters) > 1
        value: dict[str, Any] = ({"string_match": {"prefix": f"{PROCESS_ID_PREFIX}{i}."}}
                                 if several else {"present_match": True})
        log_filter: dict[str, Any] = (
            {"metadata_filter": {"matcher": {"filter": LB_METADATA_NAMESPACE,
                                             "path": [{"key": DECISION_KEY}], "value": value}}}
            if by_metadata else
            {"header_filter": {"header": {"name": DECISION_HEADER, **(
                {"string_match": value["string_match"]} if several else
                {"present_match": True})}}})
        out.append({"name": "envoy.access_loggers.http_grpc", "filter": log_filter,
                    "typed_config": {
                        "@type": T + "extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
                        "common_config": {
                            "log_name": "cachepilot", "transport_api_version": "V3",
                            "grpc_service": {"envoy_grpc": {"cluster_name": cluster}},
                            # Entries of flush_ms together, in one message (a message
                            # costs the gateway more than an entry), or each at once.
                            **({"buffer_size_bytes": 0} if flush_ms <= 0 else
                               {"buffer_size_bytes": 65536,
                                "buffer_flush_interval": f"{flush_ms / 1000}s"})},
                        # Envoy's reason for an error reply of its own (local_reply_config).
                        "additional_response_headers_to_log": [ERROR_HEADER],
                        **({} if by_metadata else
                           {"additional_request_headers_to_log": [DECISION_HEADER]})}})
    return out
