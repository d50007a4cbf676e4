"""Build ext_proc messages the way Envoy sends them (raw_value, pseudo-headers)."""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2 as al
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep


def headers(path: str, method: str = "POST", eos: bool = False, response: bool = False,
            **extra: str) -> ep.ProcessingRequest:
    pairs = {":status": extra.pop("status", "200")} if response else {
        ":path": path, ":method": method, ":authority": "gw"}
    pairs.update({k.replace("_", "-"): v for k, v in extra.items()})
    hm = ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]),
        end_of_stream=eos)
    return ep.ProcessingRequest(**{"response_headers" if response else "request_headers": hm})


def body(data: bytes, eos: bool = True, response: bool = False) -> ep.ProcessingRequest:
    b = ep.HttpBody(body=data, end_of_stream=eos)
    return ep.ProcessingRequest(**{"response_body" if response else "request_body": b})


def set_headers(resp: ep.ProcessingResponse) -> dict[str, str]:
    kind = resp.WhichOneof("response")
    common = getattr(resp, kind).response
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def access_log_entry(decision_id: str, status: int = 200, upstream: str = "",
                     usage: dict[str, int] | None = None, by_metadata: bool = True,
                     body_in_s: float | None = None, first_byte_in_s: float | None = None,
                     ended_in_s: float | None = None, error: str | None = None,
                     **flags: bool) -> al.HTTPAccessLogEntry:
    """Envoy's access log entry at a request's end: the decision id in envoy.lb metadata (a
    body-only routing answer's) or in the logged request headers, the usage its Lua filter
    read, the worker, when (since the request's start) its body was in, the worker's
    first byte came and the response's last byte went, Envoy's error header, the response flags
    (``downstream_connection_termination=True``, …)."""
    common = al.AccessLogCommon(response_flags=al.ResponseFlags(**flags))
    if body_in_s is not None:
        common.time_to_last_rx_byte.FromNanoseconds(int(body_in_s * 1e9))
    if first_byte_in_s is not None:
        common.time_to_first_upstream_rx_byte.FromNanoseconds(int(first_byte_in_s * 1e9))
    if ended_in_s is not None:
        common.time_to_last_downstream_tx_byte.FromNanoseconds(int(ended_in_s * 1e9))
    if by_metadata:
        common.metadata.filter_metadata["envoy.lb"].update(
            {"x-cachepilot-decision-id": decision_id})
    if usage:
        common.metadata.filter_metadata["cachepilot.usage"].update(usage)
    if upstream:
        host, port = upstream.rsplit(":", 1)
        common.upstream_remote_address.socket_address.address = host
        common.upstream_remote_address.socket_address.port_value = int(port)
    entry = al.HTTPAccessLogEntry(common_properties=common)
    if not by_metadata:
        entry.request.request_headers["x-cachepilot-decision-id"] = decision_id
    if status:
        entry.response.response_code.value = status
    if error:
        entry.response.response_headers["x-cachepilot-error"] = error
    return entry
