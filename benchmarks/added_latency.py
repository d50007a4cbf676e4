"""Latency that Envoy + CachePilot's ext_proc add over Envoy straight to a worker.

Four Envoys share one simulated worker (run so fast that its engine time is ~0): a plain
Envoy routing to it, Envoy + a no-op ext_proc server (grpc.aio, answers at once: the cost of
the mechanism itself), Envoy + gateway, and Envoy + gateway without response observation.
Requests (non-streamed, ~8k-token prompts) go to the three in turn at ``--rate`` requests/s
each, so machine noise lands on all of them alike; the figures are differences of
percentiles measured in one run.

    python benchmarks/added_latency.py [--rate 100] [--seconds 15]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
import grpc
import numpy as np
import orjson
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from cachepilot.gateway.envoy_config import EnvoyOptions, build_bootstrap
from cachepilot.gateway.service import DESTINATION_HEADER
from cachepilot.tooling.procs import http_get
from cachepilot.tooling.stack import envoy_binary, free_port


def direct_bootstrap(port: int, admin: int, worker: str) -> dict:
    """The same bootstrap minus ext_proc, routing to the worker as a static cluster."""
    cfg = build_bootstrap(EnvoyOptions(listen_address="127.0.0.1", listen_port=port,
                                       admin_port=admin, fail_open=True,
                                       fallback_workers=(worker,)))
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    hcm["typed_config"]["http_filters"] = hcm["typed_config"]["http_filters"][1:]
    vhost = hcm["typed_config"]["route_config"]["virtual_hosts"][0]
    vhost["routes"] = vhost["routes"][1:]  # only the fallback (static) route
    return cfg


class NoopProcessor(ep_grpc.ExternalProcessorServicer):
    """Names the worker without reading anything: what ext_proc costs before any routing."""

    def __init__(self, worker: str) -> None:
        self.set = ep.CommonResponse(header_mutation=ep.HeaderMutation(set_headers=[
            base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(
                key=DESTINATION_HEADER, raw_value=worker.encode()))]))

    async def Process(self, requests, context):  # type: ignore[no-untyped-def]
        chunks = 0
        async for msg in requests:
            if msg.HasField("request_body"):
                chunks += 1
                if msg.request_body.end_of_stream:
                    yield ep.ProcessingResponse(request_headers=ep.HeadersResponse(
                        response=self.set))
                    for _ in range(chunks):
                        yield ep.ProcessingResponse(request_body=ep.BodyResponse())


def start_noop(worker: str) -> int:
    """Run the no-op processor on its own loop in a thread; returns its port."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        ep_grpc.add_ExternalProcessorServicer_to_server(NoopProcessor(worker), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    _KEEP.append(server)
    return port


_KEEP: list[object] = []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rate", type=float, default=100.0, help="requests/s per path")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args()
    console = Console()
    tmp = Path(tempfile.mkdtemp(prefix="cachepilot-bench-"))
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(name: str, argv: list[str]) -> None:
        procs.append(subprocess.Popen(argv, stdout=open(tmp / f"{name}.log", "wb"),  # noqa: SIM115
                                      stderr=subprocess.STDOUT))

    wport, gport, aport = free_port(), free_port(), free_port()
    worker = f"127.0.0.1:{wport}"
    cp = [sys.executable, "-m", "cachepilot"]
    spawn("worker", [*cp, "sim-worker", "--port", str(wport), "--speed", "100000",
                     "--num-blocks", "65536"])
    spawn("gateway", [*cp, "gateway", "--listen", f"127.0.0.1:{gport}", "--admin-port",
                      str(aport), "--workers", worker, "--engine", "sim"])
    paths: dict[str, int] = {}
    noop_port = start_noop(worker)
    configs = {
        "envoy → worker": direct_bootstrap(free_port(), free_port(), worker),
        "envoy + no-op ext_proc": build_bootstrap(EnvoyOptions(
            listen_address="127.0.0.1", listen_port=free_port(), admin_port=free_port(),
            ext_proc_port=noop_port, observe_responses=False)),
        "envoy + cachepilot": build_bootstrap(EnvoyOptions(
            listen_address="127.0.0.1", listen_port=free_port(), admin_port=free_port(),
            ext_proc_port=gport)),
        "envoy + cachepilot, no response observation": build_bootstrap(EnvoyOptions(
            listen_address="127.0.0.1", listen_port=free_port(), admin_port=free_port(),
            ext_proc_port=gport, observe_responses=False)),
    }
    try:
        for i, (name, cfg) in enumerate(configs.items()):
            path = tmp / f"envoy{i}.yaml"
            path.write_text(yaml.safe_dump(copy.deepcopy(cfg)))
            spawn(f"envoy{i}", [envoy_binary(), "-c", str(path), "--concurrency", "1",
                                "--disable-hot-restart", "-l", "warning"])
            paths[name] = cfg["static_resources"]["listeners"][0]["address"][
                "socket_address"]["port_value"]
        deadline = time.time() + 30
        while http_get(f"http://127.0.0.1:{aport}/readyz")[0] != 200 if _up(aport) else True:
            if time.time() > deadline:
                raise TimeoutError(f"stack not ready; logs in {tmp}")
            time.sleep(0.2)
        time.sleep(1.0)
        results = asyncio.run(drive(paths, args, console))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()
    base = results["envoy → worker"]
    table = Table(title=f"End-to-end latency, {args.tokens:,}-token prompts, {args.rate:g} "
                        "req/s per path (ms)")
    for col in ("path", "n", "errors", "p50", "p99", "added p50", "added p99"):
        table.add_column(col, justify="right")
    for name, (lat, errors) in results.items():
        p50, p99 = np.percentile(lat, 50), np.percentile(lat, 99)
        b50, b99 = np.percentile(base[0], 50), np.percentile(base[0], 99)
        table.add_row(name, str(len(lat)), str(errors), f"{p50:.2f}", f"{p99:.2f}",
                      "" if name == "envoy → worker" else f"{p50 - b50:+.2f}",
                      "" if name == "envoy → worker" else f"{p99 - b99:+.2f}")
    console.print(table)
    console.print("targets: added ≤ 1 ms p50 and ≤ 3 ms p99")


def _up(port: int) -> bool:
    try:
        http_get(f"http://127.0.0.1:{port}/healthz", timeout=0.3)
        return True
    except OSError:
        return False


async def drive(paths: dict[str, int], args: argparse.Namespace, console: Console
                ) -> dict[str, tuple[np.ndarray, int]]:
    rng = random.Random(0)
    docs = ["".join(rng.choices("abcdefgh ", k=args.tokens * 4)) for _ in range(8)]
    names = list(paths)
    lat: dict[str, list[float]] = {n: [] for n in names}
    errors = dict.fromkeys(names, 0)
    n = int(args.rate * args.seconds)
    gap = 1.0 / (args.rate * len(names))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(name: str, body: bytes) -> None:
            t0 = time.perf_counter()
            async with session.post(f"http://127.0.0.1:{paths[name]}/v1/completions",
                                    data=body, headers={"content-type": "application/json"}
                                    ) as resp:
                await resp.read()
                if resp.status != 200:
                    errors[name] += 1
                    return
            lat[name].append((time.perf_counter() - t0) * 1000)

        tasks = []
        with Progress(console=console, transient=True) as progress:
            bar = progress.add_task("requests", total=n * len(names))
            start = time.perf_counter()
            for i in range(n * len(names)):
                await asyncio.sleep(max(0.0, start + i * gap - time.perf_counter()))
                body = orjson.dumps({"model": "sim-llama-8b", "max_tokens": 1,
                                     "prompt": docs[i % len(docs)] + str(i)})
                t = asyncio.create_task(one(names[i % len(names)], body))
                t.add_done_callback(lambda _t: progress.advance(bar))
                tasks.append(t)
            await asyncio.gather(*tasks)
    return {k: (np.array(v), errors[k]) for k, v in lat.items()}


if __name__ == "__main__":
    main()
