"""Build ext_proc messages the way Envoy sends them (raw_value, pseudo-headers)."""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
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
