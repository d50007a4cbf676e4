"""The gateway's whole per-request path in process, with the CPU's caches warm and cold.

One gateway as ``cachepilot gateway --engine vllm`` builds it (two idle workers, flow
control, the TTFT predictor, metrics), driven without gRPC: for each request, the routing
stream's one message (the whole body, answered with the routing), the stream's end, and
Envoy's access log entry that ends the request, as the default bootstrap sends them for an
answer that is not streamed. The prompts are ``scaling.py``'s (four documents, 95 % of
each prompt, and a tail of their own).

``hot``: request after request, as a micro-benchmark runs them, the path's code and data
stay in the CPU's caches. ``cold``: between two requests (not timed), ``--evict-mb`` MB of
memory is read, as the gRPC threads, the kernel's network stack and the event loop's other
work do between a server's requests. The ratio says how much of the gateway's cost in
service is cache misses rather than work: a micro-benchmark's figures are the hot ones.

    python benchmarks/message_path.py                       # 1, 8, 64, 220 KB
    python benchmarks/message_path.py --sizes 8,220 --requests 3000 --evict-mb 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from cachepilot.core import BlockConfig, Weights, WorkerMetrics
from cachepilot.core.router import static_router
from cachepilot.gateway.envoy_streams import EnvoyStreams, RoutingStream
from cachepilot.gateway.protocol import FIRST_TOKEN, LB_METADATA_NAMESPACE
from cachepilot.gateway.server import Gateway, GatewayConfig

sys.path.insert(0, str(Path(__file__).parent))
from extproc_throughput import access_log_entry
from scaling import prompts

WORKERS = ["127.0.0.1:9001", "127.0.0.1:9002"]


def gateway() -> EnvoyStreams:
    """The gateway's Envoy-stream adapter over two idle, freshly scraped workers."""
    router = static_router(WORKERS, engine="vllm", policy="priced", weights=Weights(),
                           models=(), block=BlockConfig(16, 4.0), capacity_blocks=4096)
    pool = next(iter(router.pools.values()))
    for addr in WORKERS:  # scraped far in the future: never stale during the run
        pool.update_metrics(addr, WorkerMetrics(waiting=0, running=0, kv_usage=0.1,
                                                num_blocks=100_000,
                                                scraped_at=time.time() + 86400))
    return Gateway(router, GatewayConfig()).servicer.streams


def one(streams: EnvoyStreams, msg: ep.ProcessingRequest) -> None:
    s = RoutingStream(body_only=True, observe=FIRST_TOKEN)
    s.ex.path = "/v1/completions"
    out = streams.handle(s, msg)
    assert isinstance(out, list) and out[0].HasField("request_body"), out
    streams.routing_ended(s)
    streams.logged(access_log_entry(
        out[0].dynamic_metadata.fields[LB_METADATA_NAMESPACE].struct_value))


def measure(kb: float, requests: int, evict: np.ndarray | None) -> list[float]:
    """µs per request, each timed alone."""
    streams = gateway()
    msgs = [ep.ProcessingRequest(request_body=ep.HttpBody(body=b, end_of_stream=True))
            for b in prompts(kb, 64)]
    for i in range(100):  # every document seen, the predictor's first fits
        one(streams, msgs[i % len(msgs)])
    times = []
    for i in range(requests):
        if evict is not None:
            evict.sum()  # read: the caches now hold this, not the path's code and data
        msg = msgs[i % len(msgs)]
        t0 = time.perf_counter()
        one(streams, msg)
        times.append((time.perf_counter() - t0) * 1e6)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,8,64,220", help="prompt KB")
    ap.add_argument("--requests", type=int, default=2000, help="per size and mode")
    ap.add_argument("--evict-mb", type=float, default=16,
                    help="memory read between two requests in the cold mode")
    args = ap.parse_args()
    evict = np.ones(int(args.evict_mb * (1 << 20)) // 8)
    print("| KB | hot µs (p50) | cold µs (p50) | cold ÷ hot |\n|---:|---:|---:|---:|")
    for kb in (float(x) for x in args.sizes.split(",")):
        hot = statistics.median(measure(kb, args.requests, None))
        cold = statistics.median(measure(kb, args.requests, evict))
        print(f"| {kb:g} | {hot:.0f} | {cold:.0f} | {cold / hot:.2f} |", flush=True)


if __name__ == "__main__":
    main()
