"""Latency a router adds over going straight to the worker, as a client sees it.

Every path fronts the same near-instant simulated worker (``sim-worker --speed 100000``), in
one run, interleaved request by request (so machine noise lands on every path alike):

* ``direct``: the client talks to the worker itself (the baseline);
* ``envoy``: a plain Envoy, round robin to the worker;
* ``sglang``: sglang-router ``cache_aware`` (PyPI, the ``peers`` extra);
* ``vllm``: vllm-router ``cache_aware``;
* ``cachepilot``: Envoy + the gateway, default configuration, with a decision log;
* optional CachePilot variants (``--variants``): ``before`` (the configuration before issue
  12: STREAMED request body, every response message sent to the gateway and waited for),
  ``headers`` (today's, but the routing stream gets a headers message before the body: two
  round trips, the default until the body-only answer), ``streamed`` (today's, but the
  request body STREAMED), ``sync-observe`` (today's, but the response answered in turn),
  ``observe-late`` (the observing stream starts at the response headers), ``observe-whole``
  (the observing stream reads the whole response, no access log: before 2026-12-07),
  ``log-each`` (Envoy's access log sends each entry at once, not 10 ms of them together: the
  default until the night of 2026-12-07), ``no-observe`` (routing only), ``no-log`` (no
  decision log), ``flow-off`` (flow control off and no flow headers forwarded: as before
  issue 25), ``flow-no-headers`` (flow control on, no flow headers forwarded: the gateway's
  share of its cost), ``uvloop`` (the gateway on uvloop's event loop), ``noop`` /
  ``noop-uvloop`` / ``noop-sync`` (Envoy + a no-op Python ext_proc server of its own:
  grpc.aio, grpc.aio on uvloop, grpcio's thread-pool server: what the mechanism costs before
  any routing; ``-headers`` / ``-streamed`` suffixes: with a headers message, with a
  STREAMED body).

Closed loop (``--loop closed``): one request in flight, the paths in turn. Open loop
(``--loop open``): ``--rate`` requests/s per path, sent on schedule whatever is in flight.
Prompts of ``--sizes`` KB, ``random`` (every prompt different) or ``shared`` (a long
common prefix, 256 bytes of their own). Non-streamed, ``max_tokens`` 1. Reported per path:
p50 and p99 end to end, added p50/p99 over ``direct``, and CachePilot's added latency as a
ratio of sglang-router's (the issue's bar: p50 ≤ 1.5× or within 0.5 ms, p99 ≤ 2×).

    python benchmarks/added_latency.py                      # closed loop, 8 and 32 KB, both
    python benchmarks/added_latency.py --loop open --rate 50 --variants sync-observe,no-observe
    python benchmarks/added_latency.py --json runs/added.json
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
import orjson
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from rich.console import Console
from rich.table import Table

from cachepilot.deploy.envoy import EnvoyOptions
from cachepilot.deploy.envoy import bootstrap as build_bootstrap
from cachepilot.gateway.protocol import (
    BODY_METADATA,
    BODY_ONLY,
    BUFFERED_BODY,
    DESTINATION_HEADER,
    OBSERVE_ROLE,
    ROLE_METADATA,
    lb_metadata,
)
from cachepilot.tooling.procs import wait_http_ok
from cachepilot.tooling.stack import envoy_binary, free_port

MODEL = "sim-llama-8b"
PEERS = {"sglang": ("sglang-router", "launch", "warn", "readiness"),
         "vllm": ("vllm-router", None, "warning", "health")}


def direct_bootstrap(port: int, admin: int, *workers: str) -> dict:
    """The gateway's bootstrap minus ext_proc, routing to the workers as a static cluster
    (round robin): plain Envoy."""
    cfg = build_bootstrap(EnvoyOptions(listen_address="127.0.0.1", listen_port=port,
                                       admin_port=admin, fail_open=True,
                                       fallback_workers=workers))
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][-1]
    hcm["typed_config"]["http_filters"] = hcm["typed_config"]["http_filters"][-1:]
    hcm["typed_config"].pop("access_log", None)  # no gateway to log to
    vhost = hcm["typed_config"]["route_config"]["virtual_hosts"][0]
    vhost["routes"] = vhost["routes"][-1:]  # only the fallback (static) route
    return cfg


class NoopProcessor(ep_grpc.ExternalProcessorServicer):
    """Names the worker without reading anything: what ext_proc costs before any routing.
    Answers as the gateway does: body-only (the body is the one message; its answer routes by
    envoy.lb metadata), BUFFERED bodies after a headers message (headers answered at once,
    the body's answer routes) or STREAMED ones (the headers answered at the last chunk, then
    each chunk)."""

    def __init__(self, worker: str) -> None:
        self.set = ep.CommonResponse(header_mutation=ep.HeaderMutation(set_headers=[
            base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(
                key=DESTINATION_HEADER, raw_value=worker.encode()))]))
        self.cont = ep.ProcessingResponse(request_headers=ep.HeadersResponse())
        self.routed = ep.ProcessingResponse(request_body=ep.BodyResponse(response=self.set))
        self.by_metadata = ep.ProcessingResponse(
            request_body=ep.BodyResponse(response=ep.CommonResponse(
                header_mutation=self.set.header_mutation, clear_route_cache=True)),
            dynamic_metadata=lb_metadata(worker))

    @staticmethod
    def body_mode(context) -> str:  # type: ignore[no-untyped-def]
        """The stream's x-cachepilot-body metadata ("only", "buffered"), "" when STREAMED."""
        return next((v for k, v in context.invocation_metadata() or () if k == BODY_METADATA),
                    "")

    def replies(self, mode: str, msg: ep.ProcessingRequest, chunks: int
                ) -> tuple[list[ep.ProcessingResponse], int]:
        """The answers to one message (and the body chunks seen so far), as the gateway gives
        them in each body mode; the async and the thread-pool servers both use this."""
        if mode == BODY_ONLY:
            return [self.by_metadata], chunks
        if mode == BUFFERED_BODY:
            return [self.cont if msg.HasField("request_headers") else self.routed], chunks
        if not msg.HasField("request_body"):
            return [], chunks
        if not msg.request_body.end_of_stream:
            return [], chunks + 1
        return ([ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=self.set))]
                + [ep.ProcessingResponse(request_body=ep.BodyResponse())] * (chunks + 1), 0)

    @staticmethod
    def observing(context) -> bool:  # type: ignore[no-untyped-def]
        """An observing stream (x-cachepilot-role: observe): Envoy waits for no answer."""
        return any(k == ROLE_METADATA and v == OBSERVE_ROLE
                   for k, v in context.invocation_metadata() or ())

    async def Process(self, requests, context):  # type: ignore[no-untyped-def]
        if self.observing(context):  # read to the end, as the gateway does; answer nothing
            async for _ in requests:
                pass
            return
        mode, chunks = self.body_mode(context), 0
        async for msg in requests:
            out, chunks = self.replies(mode, msg, chunks)
            for resp in out:
                yield resp


def start_noop(worker: str, uvloop: bool = False) -> int:
    """The no-op processor on its own loop in a thread; returns its port."""
    if uvloop:
        import uvloop as uv
        loop = uv.new_event_loop()
    else:
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


class SyncNoopProcessor(ep_grpc.ExternalProcessorServicer):
    """The no-op processor on grpcio's thread-pool server (no asyncio)."""

    def __init__(self, worker: str) -> None:
        self.inner = NoopProcessor(worker)

    def Process(self, requests, context):  # type: ignore[no-untyped-def]
        mode, chunks = self.inner.body_mode(context), 0
        for msg in requests:
            out, chunks = self.inner.replies(mode, msg, chunks)
            yield from out


def serve_noop(port: int, worker: str, kind: str) -> None:
    """``--serve-noop``: a no-op processor as its own process (not sharing the client's GIL)."""
    if kind == "sync":
        from concurrent.futures import ThreadPoolExecutor
        server = grpc.server(ThreadPoolExecutor(max_workers=8))
        ep_grpc.add_ExternalProcessorServicer_to_server(SyncNoopProcessor(worker), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        server.wait_for_termination()
        return

    async def run() -> None:
        server = grpc.aio.server()
        ep_grpc.add_ExternalProcessorServicer_to_server(NoopProcessor(worker), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    if kind == "uvloop":
        import uvloop
        uvloop.install()
    asyncio.run(run())


class Stack:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, name: str, argv: list[str]) -> None:
        self.procs.append(subprocess.Popen(argv, stdout=open(self.tmp / f"{name}.log", "wb"),  # noqa: SIM115
                                           stderr=subprocess.STDOUT))

    def envoy(self, name: str, cfg: dict) -> int:
        path = self.tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(copy.deepcopy(cfg)))
        self.spawn(name, [envoy_binary(), "-c", str(path), "--concurrency", "1",
                          "--disable-hot-restart", "-l", "warning"])
        return cfg["static_resources"]["listeners"][0]["address"]["socket_address"][
            "port_value"]

    def gateway(self, name: str, worker: str, *extra: str, uvloop: bool = False,
                log: bool = True) -> tuple[int, int]:
        gport, aport = free_port(), free_port()
        # uvloop: the same CLI with uvloop's event loop policy installed first.
        run = (["-c", "import sys, uvloop; uvloop.install(); sys.argv[0] = 'cachepilot'; "
                      "from cachepilot.cli import main; main()"] if uvloop
               else ["-m", "cachepilot"])
        logs = ["--decision-log", str(self.tmp / f"{name}-log")] if log else []
        self.spawn(name, [sys.executable, *run, "gateway", "--listen",
                          f"127.0.0.1:{gport}", "--admin-port", str(aport), "--workers", worker,
                          "--engine", "sim", *logs, *extra])
        return gport, aport

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def build(stack: Stack, worker: str, paths: list[str], variants: list[str]
          ) -> tuple[dict[str, int], list[str]]:
    """Start every path; returns name → HTTP port, and the URLs that say it is ready."""
    ports: dict[str, int] = {"direct": int(worker.rsplit(":", 1)[1])}
    ready: list[str] = []

    def opts(gport: int, **kw: Any) -> EnvoyOptions:
        return EnvoyOptions(listen_address="127.0.0.1", listen_port=free_port(),
                            admin_port=free_port(), ext_proc_port=gport, workers=(worker,), **kw)

    if "envoy" in paths:
        ports["envoy"] = stack.envoy("envoy", direct_bootstrap(free_port(), free_port(), worker))
    for peer in ("sglang", "vllm"):
        if peer in paths:
            exe, sub, quiet, health = PEERS[peer]
            port = free_port()
            stack.spawn(peer, [str(Path(sys.executable).parent / exe), *([sub] if sub else []),
                               "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
                               f"http://{worker}", "--policy", "cache_aware",
                               "--prometheus-port", str(free_port()), "--log-level", quiet])
            ports[peer] = port
            ready.append(f"http://127.0.0.1:{port}/{health}")
    gateways: dict[str, tuple[tuple[str, ...], dict[str, Any], dict[str, Any]]] = {
        "cachepilot": ((), {}, {}), "sync-observe": ((), {"observe_async": False}, {}),
        "no-observe": (("--no-observe-responses",), {"observe_responses": False}, {}),
        "no-log": ((), {}, {"log": False}), "uvloop": ((), {}, {"uvloop": True}),
        "observe-late": ((), {"observe_request_headers": False}, {}),
        # The observing stream reads the whole response (no access log): before 2026-12-07.
        "observe-whole": ((), {"observe_until_first_token": False}, {}),
        # Envoy's access log sends each entry at once, not 10 ms of them together: the
        # default until the night of 2026-12-07.
        "log-each": ((), {"access_log_flush_ms": 0}, {}),
        "streamed": ((), {"request_body_mode": "STREAMED"}, {}),
        "headers": ((), {"send_request_headers": True}, {}),
        "before": ((), {"request_body_mode": "STREAMED", "observe_async": False}, {}),
        # Flow control off, and Envoy forwarding no flow headers: as before issue 25.
        "flow-off": (("--flow-control", "off"), {"flow_headers": ()}, {}),
        # Flow control on, but Envoy forwards no flow headers: the gateway's share of its cost.
        "flow-no-headers": ((), {"flow_headers": ()}, {})}
    for name in ["cachepilot", *variants] if "cachepilot" in paths else variants:
        if name.startswith("noop"):
            nport = free_port()
            kind = (name.removeprefix("noop").strip("-").replace("streamed", "")
                    .replace("headers", "").strip("-") or "aio")
            stack.spawn(name, [sys.executable, __file__, "--serve-noop", str(nport), worker,
                               kind])
            body = "STREAMED" if name.endswith("streamed") else "BUFFERED"
            cfg = build_bootstrap(opts(nport, observe_responses=False, request_body_mode=body,
                                       send_request_headers=name.endswith("headers")))
        else:
            args, kw, how = gateways[name]
            gport, aport = stack.gateway(f"gw-{name}", worker, *args, **how)
            cfg = build_bootstrap(opts(gport, **kw))
            ready.append(f"http://127.0.0.1:{aport}/readyz")
        ports[name] = stack.envoy(f"envoy-{name}", cfg)
    return ports, ready


def prompts(kind: str, size: int, n: int, rng: random.Random) -> list[str]:
    """``random``: every prompt its own text; ``shared``: one of 4 long common prefixes, then
    256 bytes of its own."""
    alphabet = "abcdefghijklmnopqrstuvwxyz     "
    if kind == "random":
        pool = "".join(rng.choices(alphabet, k=size * 8))
        return [f"{i} " + pool[(o := rng.randrange(len(pool) - size)):o + size - 8]
                for i in range(n)]
    heads = ["".join(rng.choices(alphabet, k=size - 256)) for _ in range(4)]
    return [heads[i % 4] + "".join(rng.choices(alphabet, k=256)) for i in range(n)]


async def run_cell(session: aiohttp.ClientSession, ports: dict[str, int], bodies: list[bytes],
                   loop: str, rate: float) -> dict[str, tuple[np.ndarray, int]]:
    names = list(ports)
    lat: dict[str, list[float]] = {n: [] for n in names}
    errors = dict.fromkeys(names, 0)

    async def one(name: str, body: bytes) -> None:
        t0 = time.perf_counter()
        try:
            async with session.post(f"http://127.0.0.1:{ports[name]}/v1/completions", data=body,
                                    headers={"content-type": "application/json"}) as resp:
                await resp.read()
                ok = resp.status == 200
        except aiohttp.ClientError:
            ok = False
        if ok:
            lat[name].append((time.perf_counter() - t0) * 1000)
        else:
            errors[name] += 1

    # Warm every path's connections (not counted).
    for name in names:
        for body in bodies[:5]:
            await one(name, body)
    for n in names:
        lat[n].clear()
        errors[n] = 0
    order = list(names)
    if loop == "closed":
        for i, body in enumerate(bodies):
            random.Random(i).shuffle(order)  # each round in its own order
            for name in order:
                await one(name, body)
    else:
        gap = 1.0 / (rate * len(names))
        tasks = []
        start = time.perf_counter()
        k = 0
        for body in bodies:
            for name in names:
                await asyncio.sleep(max(0.0, start + k * gap - time.perf_counter()))
                tasks.append(asyncio.create_task(one(name, body)))
                k += 1
        await asyncio.gather(*tasks)
    return {k: (np.array(v), errors[k]) for k, v in lat.items()}


def summarise(res: dict[str, tuple[np.ndarray, int]]) -> dict[str, dict[str, float]]:
    b50, b99 = (float(np.percentile(res["direct"][0], q)) for q in (50, 99))
    out = {}
    for name, (lat, err) in res.items():
        p50, p99 = (float(np.percentile(lat, q)) if len(lat) else float("nan") for q in (50, 99))
        out[name] = {"n": len(lat), "errors": err, "p50_ms": p50, "p99_ms": p99,
                     "added_p50_ms": p50 - b50, "added_p99_ms": p99 - b99}
    return out


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--serve-noop":
        serve_noop(int(sys.argv[2]), sys.argv[3], sys.argv[4])
        return
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loop", choices=["closed", "open", "both"], default="closed")
    ap.add_argument("--sizes", default="8,32", help="prompt sizes in KB")
    ap.add_argument("--prompts", default="random,shared")
    ap.add_argument("--requests", type=int, default=300, help="per path and cell")
    ap.add_argument("--rate", type=float, default=50.0, help="open loop: requests/s per path")
    ap.add_argument("--paths", default="direct,envoy,sglang,vllm,cachepilot")
    ap.add_argument("--variants", default="",
                    help="before,streamed,sync-observe,observe-late,observe-whole,no-observe,"
                         "no-log,flow-off,flow-no-headers,"
                         "uvloop,"
                         "noop,noop-streamed,noop-uvloop,noop-sync")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    console = Console()
    tmp = Path(tempfile.mkdtemp(prefix="cachepilot-added-"))
    stack = Stack(tmp)
    wport = free_port()
    worker = f"127.0.0.1:{wport}"
    stack.spawn("worker", [sys.executable, "-m", "cachepilot", "sim-worker", "--port",
                           str(wport), "--speed", "100000", "--num-blocks", "262144"])
    paths = [p for p in args.paths.split(",") if p]
    variants = [v for v in args.variants.split(",") if v]
    loops = ["closed", "open"] if args.loop == "both" else [args.loop]
    results: dict[str, Any] = {"command": " ".join(sys.argv), "cells": []}
    try:
        ports, ready = build(stack, worker, paths, variants)
        wait_http_ok([f"http://{worker}/metrics", *ready])
        time.sleep(1.5)  # a scrape or two

        async def drive() -> None:
            rng = random.Random(0)
            conn = aiohttp.TCPConnector(limit=0, force_close=False)
            async with aiohttp.ClientSession(connector=conn) as session:
                for loop in loops:
                    for kb in (int(s) for s in args.sizes.split(",")):
                        for kind in args.prompts.split(","):
                            texts = prompts(kind, kb * 1024, args.requests + 5, rng)
                            bodies = [orjson.dumps({"model": MODEL, "max_tokens": 1,
                                                    "prompt": t}) for t in texts]
                            t0 = time.time()
                            res = await run_cell(session, ports, bodies, loop, args.rate)
                            cell = {"loop": loop, "kb": kb, "prompts": kind,
                                    "seconds": round(time.time() - t0, 1),
                                    "paths": summarise(res)}
                            results["cells"].append(cell)
                            show(console, cell)

        asyncio.run(drive())
    finally:
        stack.stop()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    console.print(f"logs: {tmp}")


def show(console: Console, cell: dict[str, Any]) -> None:
    p = cell["paths"]
    table = Table(title=f"{cell['loop']} loop, {cell['kb']} KB {cell['prompts']} prompts "
                        f"({cell['seconds']} s): ms")
    for col in ("path", "n", "err", "p50", "p99", "added p50", "added p99",
                "÷ sglang p50", "÷ sglang p99"):
        table.add_column(col, justify="right")
    sg = p.get("sglang")
    for name, r in p.items():
        ratio = ("", "")
        if sg and name not in ("direct", "sglang"):
            ratio = tuple(f"{r[k] / sg[k]:.2f}" if sg[k] > 0 else "inf"
                          for k in ("added_p50_ms", "added_p99_ms"))
        table.add_row(name, str(r["n"]), str(r["errors"]), f"{r['p50_ms']:.2f}",
                      f"{r['p99_ms']:.2f}",
                      "" if name == "direct" else f"{r['added_p50_ms']:+.2f}",
                      "" if name == "direct" else f"{r['added_p99_ms']:+.2f}", *ratio)
    console.print(table)


if __name__ == "__main__":
    main()
