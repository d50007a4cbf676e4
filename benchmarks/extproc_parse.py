"""Why the gateway uses xds-protos: parse and serialize cost of ext_proc messages with gRPC's
generated protobuf classes (upb) against envoy-data-plane's betterproto2 classes.

    python benchmarks/extproc_parse.py
"""

from __future__ import annotations

import timeit

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from rich.console import Console
from rich.table import Table


def sample(body_bytes: int) -> bytes:
    text = "x" * body_bytes
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})
    msg = ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))
    return msg.SerializeToString()


def response() -> ep.ProcessingResponse:
    opt = base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(
        key="x-gateway-destination-endpoint", raw_value=b"10.0.0.1:8000"))
    return ep.ProcessingResponse(request_body=ep.BodyResponse(response=ep.CommonResponse(
        header_mutation=ep.HeaderMutation(set_headers=[opt]), clear_route_cache=True)))


def per_call_us(fn, number: int) -> float:  # type: ignore[no-untyped-def]
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def main() -> None:
    console = Console()
    table = Table(title="ext_proc message cost per call (µs, best of 5)")
    for col in ("body", "xds-protos parse", "betterproto2 parse", "ratio",
                "xds-protos build+serialize response"):
        table.add_column(col, justify="right")
    try:
        from envoy_data_plane.envoy.service.ext_proc.v3 import ProcessingRequest as BpRequest
    except ImportError:  # optional: only this benchmark needs it
        BpRequest = None
    for size in (1_000, 20_000, 128_000):
        raw = sample(size)
        upb = per_call_us(lambda raw=raw: ep.ProcessingRequest.FromString(raw), 2000)
        bp = (per_call_us(lambda raw=raw: BpRequest.FromString(raw), 50)
              if BpRequest else float("nan"))
        resp = per_call_us(lambda: response().SerializeToString(), 5000)
        table.add_row(f"{size // 1000} KB", f"{upb:.2f}", f"{bp:.1f}", f"{bp / upb:.0f}×",
                      f"{resp:.2f}")
    console.print(table)
    if BpRequest is None:
        console.print("envoy-data-plane is not installed: pip install envoy-data-plane")


if __name__ == "__main__":
    main()
