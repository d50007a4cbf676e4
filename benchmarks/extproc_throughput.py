"""Requests per second one gateway process sustains: its ext_proc service driven directly by a
gRPC load driver shaped like Envoy, without Envoy in the way.

Each request is what Envoy sends with the default bootstrap: a routing stream (the whole body
as its one message, whose answer routes: the latency measured, from sending the body to that
answer) and, at its end, an access log entry (the decision id in envoy.lb metadata, the
usage, the worker), which Envoy never waits for; the answers are not streamed, so the
routing answer marks them unobserved and no observing stream is opened (``Driver``). The
workers are fake: one process answers every worker's ``/metrics`` with a fixed, idle vLLM
exposition, so the gateway scrapes and prices them as it would real ones (at its default
scrape interval).

Two figures per cell. The gateway's CPU time per request (user + system, all its threads,
from /proc) gives what one core sustains when the process has it to itself:
1000 / CPU ms per request. And the measured saturation point: open loop, in steps of rising
rate; a step's p99 against the first (light) step's p99: the
saturation point is the last rate whose p99 is at most twice that, with at least 95 % of
the requests answered in the step. The gateway process (``--processes`` of them: the driver
spreads the streams over them, as Envoy's ext_proc cluster would) is pinned to CPU 0 (one
core) and the driver to the others, when the machine has more than one.

    python benchmarks/extproc_throughput.py                       # 1k/8k/32k x 3/16/64
    python benchmarks/extproc_throughput.py --tokens 8192 --workers 16 --processes 2
    python benchmarks/extproc_throughput.py --noop                # the driver's own ceiling
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import orjson
from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2 as al
from envoy.service.accesslog.v3 import als_pb2 as als
from envoy.service.accesslog.v3 import als_pb2_grpc as als_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from rich.console import Console
from rich.table import Table

from cachepilot.gateway.protocol import (
    BODY_METADATA,
    BODY_ONLY,
    CHOSEN_KEY,
    FIRST_TOKEN,
    LB_METADATA_NAMESPACE,
    OBSERVE_METADATA,
    OBSERVE_ROLE,
    PATH_METADATA,
    ROLE_METADATA,
    UNOBSERVED_KEY,
    USAGE_NAMESPACE,
    WORKER_HEADER,
)
from cachepilot.tooling.procs import process_stat, wait_http_ok
from cachepilot.tooling.stack import free_port

METRICS = """# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.1
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="65536"} 1
"""


def serve_metrics(ports: list[int]) -> None:
    """``--serve-metrics``: every port answers /metrics (and /health) with an idle worker."""
    from aiohttp import web

    async def run() -> None:
        app = web.Application()
        app.router.add_get("/metrics", lambda _: web.Response(text=METRICS))
        app.router.add_get("/health", lambda _: web.Response(text="ok"))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        for p in ports:
            await web.TCPSite(runner, "127.0.0.1", p).start()
        await asyncio.Event().wait()

    asyncio.run(run())


def hm(pairs: dict[str, str], eos: bool = False) -> ep.HttpHeaders:
    return ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]),
        end_of_stream=eos)


USAGE = (b'{"id":"x","object":"text_completion","choices":[{"text":"t"}],"usage":'
         b'{"prompt_tokens":8192,"completion_tokens":1,"prompt_tokens_details":'
         b'{"cached_tokens":4096}}}')

TOKEN_EVENT = (b'data: {"id":"x","object":"text_completion","choices":[{"index":0,'
               b'"text":" token","finish_reason":null}]}\n\n')


def access_log_entry(lb: Any) -> al.HTTPAccessLogEntry:
    """Envoy's access log entry for a routed request that was answered (200): the routing
    answer's envoy.lb metadata ``lb``, the usage its Lua filter read, the worker and timings."""
    entry = al.HTTPAccessLogEntry()
    c = entry.common_properties
    c.metadata.filter_metadata[LB_METADATA_NAMESPACE].CopyFrom(lb)
    c.metadata.filter_metadata[USAGE_NAMESPACE].update(
        {"cached_tokens": 4096, "completion_tokens": 1})
    host, port = lb.fields[CHOSEN_KEY].string_value.rsplit(":", 1)
    c.upstream_remote_address.socket_address.address = host
    c.upstream_remote_address.socket_address.port_value = int(port)
    c.time_to_last_rx_byte.FromMicroseconds(100)
    c.time_to_first_upstream_rx_byte.FromMicroseconds(600)
    c.time_to_last_downstream_tx_byte.FromMicroseconds(700)
    entry.response.response_code.value = 200
    return entry


class Driver:
    """Envoy's side of the default bootstrap. ``observe``: responses are observed, until the
    first token (``until_first_token``, the default: a request the routing answer marks
    unobserved, not streamed, gets no observing stream, only an access log entry at its end,
    on one log stream per process as Envoy keeps, sent with the others of ``log_flush_ms``)
    or whole (an observing stream carrying every body message, ``--observe-until end``)."""

    def __init__(self, ports: list[int], observe: bool, response_chunks: int = 1,
                 until_first_token: bool = True, log_flush_ms: float = 10.0) -> None:
        self.channels = [grpc.aio.insecure_channel(f"127.0.0.1:{p}") for p in ports]
        self.stubs = [ep_grpc.ExternalProcessorStub(c) for c in self.channels]
        self.observe = observe
        self.mode = ("off" if not observe else FIRST_TOKEN if until_first_token else "async")
        self.log_stubs = [als_grpc.AccessLogServiceStub(c) for c in self.channels]
        self.logs: dict[int, tuple[Any, asyncio.Lock]] = {}
        # Envoy's access log sends the entries of log_flush_ms together (the bootstrap's
        # default, EnvoyOptions.access_log_flush_ms), 0: each at once.
        self.log_flush_s = log_flush_ms / 1000.0
        self.batches: dict[int, list[al.HTTPAccessLogEntry]] = {}
        # The response body as this many messages (a streamed answer: one SSE event of a
        # token each, as Envoy's STREAMED observing filter passes them on), usage last.
        self.response = [ep.ProcessingRequest(response_body=ep.HttpBody(body=TOKEN_EVENT))
                         for _ in range(response_chunks - 1)]
        self.response.append(ep.ProcessingRequest(response_body=ep.HttpBody(
            body=USAGE, end_of_stream=True)))
        self.i = 0
        self.pending: set[asyncio.Task[None]] = set()

    async def one(self, body: bytes) -> tuple[float, bool]:
        """Route one request as Envoy does with the default bootstrap (body-only: the whole
        body is the stream's one message, its answer routes and the gateway ends the stream);
        returns (ms until the routing answer, ok)."""
        self.i += 1
        k = self.i % len(self.stubs)
        stub = self.stubs[k]
        t0 = time.perf_counter()
        call = stub.Process(metadata=((BODY_METADATA, BODY_ONLY),
                                      (PATH_METADATA, "/v1/completions"),
                                      (OBSERVE_METADATA, self.mode)))
        await call.write(ep.ProcessingRequest(request_body=ep.HttpBody(
            body=body, end_of_stream=True)))
        routed = await call.read()
        ok = routed is not grpc.aio.EOF and routed.HasField("request_body")
        ms = (time.perf_counter() - t0) * 1000
        await call.done_writing()
        while await call.read() is not grpc.aio.EOF:  # the end
            pass
        if ok and self.observe:
            lb = routed.dynamic_metadata.fields[LB_METADATA_NAMESPACE].struct_value  # type: ignore[union-attr]
            t = asyncio.create_task(self._log(k, lb) if UNOBSERVED_KEY in lb.fields
                                    else self._observe(stub, lb))
            self.pending.add(t)
            t.add_done_callback(self.pending.discard)
        return ms, ok

    async def _log(self, k: int, lb: Any) -> None:
        """Envoy's access log entry at the request's end, on process ``k``'s log stream:
        the decision in envoy.lb, the usage Envoy's Lua filter read, the worker, status and
        timings."""
        if k not in self.logs:
            self.logs[k] = (self.log_stubs[k].StreamAccessLogs(), asyncio.Lock())
        call, lock = self.logs[k]
        if self.log_flush_s > 0:
            batch = self.batches.setdefault(k, [])
            batch.append(access_log_entry(lb))
            if len(batch) > 1:
                return  # the first entry's task sends them all
            await asyncio.sleep(self.log_flush_s)
            entries = self.batches.pop(k)
        else:
            entries = [access_log_entry(lb)]
        async with lock:  # one write at a time on a stream
            await call.write(als.StreamAccessLogsMessage(
                http_logs=als.StreamAccessLogsMessage.HTTPAccessLogEntries(
                    log_entry=entries)))

    async def close(self) -> None:
        """End the log streams (as Envoy does when it stops), then the channels."""
        for call, lock in self.logs.values():
            async with lock:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await call.done_writing()
                    await call
        await asyncio.gather(*(c.close() for c in self.channels))

    async def _observe(self, stub: Any, lb: Any) -> None:
        """The observing stream: request headers with the routing answer's envoy.lb metadata
        (as Envoy's observing filter forwards it), response headers and body."""
        call = stub.Process(metadata=((ROLE_METADATA, OBSERVE_ROLE),))
        first = ep.ProcessingRequest(request_headers=hm({":path": "/v1/completions"}))
        first.metadata_context.filter_metadata[LB_METADATA_NAMESPACE].CopyFrom(lb)
        await call.write(first)
        chosen = lb.fields[CHOSEN_KEY].string_value
        await call.write(ep.ProcessingRequest(response_headers=hm({
            ":status": "200", WORKER_HEADER: chosen})))
        for msg in self.response:
            await call.write(msg)
        await call.done_writing()
        with contextlib.suppress(grpc.aio.AioRpcError):
            await call.read()  # the end: the gateway answers nothing

    async def step(self, bodies: list[bytes], rate: float, seconds: float
                   ) -> tuple[np.ndarray, int, int, float]:
        n = max(1, int(rate * seconds))
        lat: list[float] = []
        errors = 0
        tasks = []
        start = time.perf_counter()
        for k in range(n):
            delay = start + k / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.one(bodies[k % len(bodies)])))
        done_by = start + seconds + 5.0
        for t in tasks:
            try:
                async with asyncio.timeout(max(0.01, done_by - time.perf_counter())):
                    ms, ok = await t
            except (TimeoutError, grpc.aio.AioRpcError):
                errors += 1
                continue
            if ok:
                lat.append(ms)
            else:
                errors += 1
        wall = time.perf_counter() - start
        while self.pending:  # let observation catch up before the next step
            await asyncio.sleep(0.05)
        return np.array(lat), errors, n, wall


def bodies_for(tokens: int, n: int, seed: int = 0) -> list[bytes]:
    """Prompts of ``tokens`` x 4 characters: one of 32 shared prefixes (3/4 of the prompt),
    then text of their own."""
    rng = random.Random(seed)
    chars = tokens * 4
    alphabet = "abcdefghijklmnopqrstuvwxyz     "
    heads = ["".join(rng.choices(alphabet, k=chars * 3 // 4)) for _ in range(32)]
    pool = "".join(rng.choices(alphabet, k=chars))
    out = []
    for i in range(n):
        o = rng.randrange(len(pool) // 2)
        tail = f"{i} " + (pool + pool)[o:o + chars // 4]
        out.append(orjson.dumps({"model": "m", "max_tokens": 1,
                                 "prompt": heads[i % 32] + tail}))
    return out


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time the processes (all their threads) have used so far."""
    total = 0.0
    for pid in pids:
        st = process_stat(pid)
        if st is None:
            raise ProcessLookupError(f"process {pid} has exited")
        total += st[1]
    return total


def wait_port(port: int, timeout_s: float = 60.0) -> None:
    import socket
    deadline = time.time() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.2)


def pin(pid: int, cpus: set[int]) -> None:
    with contextlib.suppress(OSError):
        os.sched_setaffinity(pid, cpus)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1024,8192,32768")
    ap.add_argument("--workers", default="3,16,64")
    ap.add_argument("--processes", type=int, default=1, help="gateway processes")
    ap.add_argument("--rates", default="50,200,400,600,800,1000,1200,1500,2000,2500",
                    help="requests/s, the first the light reference step")
    ap.add_argument("--seconds", type=float, default=3.0, help="per step")
    ap.add_argument("--no-observe", action="store_true",
                    help="routing streams only (gateway --no-observe-responses)")
    ap.add_argument("--no-log", action="store_true", help="no decision log")
    ap.add_argument("--noop", action="store_true", help="drive a no-op processor instead")
    ap.add_argument("--no-pin", action="store_true",
                    help="let the gateway use every core (default: pinned to CPU 0)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if len(sys.argv) > 2 and sys.argv[1] == "--serve-metrics":
        return
    console = Console()
    tmp = Path(tempfile.mkdtemp(prefix="cachepilot-tput-"))
    ncpu = os.cpu_count() or 1
    gw_cpus = {0}
    drv_cpus = set(range(1, ncpu)) or {0}
    pin(0, drv_cpus)
    counts = [int(w) for w in args.workers.split(",")]
    wports = [free_port() for _ in range(max(counts))]
    procs = [subprocess.Popen([sys.executable, __file__, "--serve-metrics",
                               *map(str, wports)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.STDOUT)]
    pin(procs[0].pid, drv_cpus)
    results: dict[str, Any] = {"command": " ".join(sys.argv), "cpus": ncpu, "cells": []}
    rates = [float(r) for r in args.rates.split(",")]
    try:
        for nw in counts:
            workers = ",".join(f"127.0.0.1:{p}" for p in wports[:nw])
            gprocs, gports = [], []
            for i in range(args.processes):
                gport, aport = free_port(), free_port()
                if args.noop:
                    argv = [sys.executable, str(Path(__file__).parent / "added_latency.py"),
                            "--serve-noop", str(gport), "127.0.0.1:1", "aio"]
                else:
                    argv = [sys.executable, "-m", "cachepilot", "gateway", "--listen",
                            f"127.0.0.1:{gport}", "--admin-port", str(aport), "--workers",
                            workers, "--engine", "vllm",
                            *([] if args.no_log else ["--decision-log",
                                                      str(tmp / f"log-{nw}-{i}")]),
                            *(["--no-observe-responses"] if args.no_observe else [])]
                p = subprocess.Popen(argv, stdout=open(tmp / f"gw-{nw}-{i}.log", "wb"),  # noqa: SIM115
                                     stderr=subprocess.STDOUT)
                # One core for one process; several share what the machine has.
                if not args.no_pin:
                    pin(p.pid, gw_cpus if args.processes == 1 else set(range(ncpu)))
                gprocs.append(p)
                gports.append(gport)
                wait_port(gport)
                if not args.noop:
                    wait_http_ok([f"http://127.0.0.1:{aport}/readyz"],
                                 hint=f"; logs in {tmp}")
            procs += gprocs
            time.sleep(1.0)
            for tokens in (int(t) for t in args.tokens.split(",")):
                cell = asyncio.run(run_cell(gports, [p.pid for p in gprocs], tokens, nw, rates,
                                            args, console))
                results["cells"].append(cell)
            for p in gprocs:
                p.terminate()
                p.wait(10)
                procs.remove(p)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
    summary(console, results, args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))


async def run_cell(ports: list[int], pids: list[int], tokens: int, nw: int, rates: list[float],
                   args: argparse.Namespace, console: Console) -> dict[str, Any]:
    drv = Driver(ports, observe=not args.no_observe and not args.noop)
    bodies = bodies_for(tokens, 200 if tokens > 16384 else 600)
    for b in bodies[:20]:  # warm up (not counted)
        await drv.one(b)
    steps = []
    base_p99 = None
    sustained = 0.0
    for rate in rates:
        cpu0 = cpu_seconds(pids)
        lat, errors, n, wall = await drv.step(bodies, rate, args.seconds)
        cpu_ms = (cpu_seconds(pids) - cpu0) * 1000 / max(1, len(lat))
        p50 = float(np.percentile(lat, 50)) if len(lat) else float("nan")
        p99 = float(np.percentile(lat, 99)) if len(lat) else float("nan")
        answered = len(lat) / n
        steps.append({"rate": rate, "n": n, "errors": errors, "p50_ms": p50, "p99_ms": p99,
                      "answered": answered, "achieved_rps": len(lat) / wall,
                      "cpu_ms_per_request": cpu_ms})
        console.print(f"  {tokens:>6} tok {nw:>2} workers {rate:>5.0f}/s: p50 {p50:6.2f} "
                      f"p99 {p99:7.2f} ms, {answered:4.0%} answered, {cpu_ms:.2f} CPU ms/req",
                      soft_wrap=True)
        if base_p99 is None:
            base_p99 = p99
            continue
        if p99 <= 2 * base_p99 and answered >= 0.95:
            sustained = rate
        else:
            break
    await drv.close()
    # CPU per request where the process was busiest without falling behind: what one core
    # would sustain if the process had it to itself.
    busy = [s for s in steps if s["answered"] >= 0.95 and s["rate"] > rates[0]] or steps
    cpu_ms = float(np.median([s["cpu_ms_per_request"] for s in busy]))
    return {"tokens": tokens, "workers": nw, "processes": args.processes,
            "base_p99_ms": base_p99, "sustained_rps": sustained, "steps": steps,
            "cpu_ms_per_request": cpu_ms, "rps_per_core_from_cpu": 1000.0 / cpu_ms}


def summary(console: Console, results: dict[str, Any], args: argparse.Namespace) -> None:
    what = "no-op processor" if args.noop else "gateway"
    table = Table(title=f"Saturation of {args.processes} {what} process(es): req/s until "
                        "p99 doubles (light-load p99 in brackets)")
    counts = sorted({c["workers"] for c in results["cells"]})
    table.add_column("prompt tokens", justify="right")
    for n in counts:
        table.add_column(f"{n} workers", justify="right")
    for tokens in sorted({c["tokens"] for c in results["cells"]}):
        row = [f"{tokens:,}"]
        for n in counts:
            c = next((c for c in results["cells"] if c["tokens"] == tokens
                      and c["workers"] == n), None)
            row.append("" if c is None else
                       f"{c['sustained_rps']:,.0f} ({c['base_p99_ms']:.1f} ms); "
                       f"{c['cpu_ms_per_request']:.2f} CPU ms/req = "
                       f"{c['rps_per_core_from_cpu']:,.0f}/core")
        table.add_row(*row)
    console.print(table)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--serve-metrics":
        serve_metrics([int(p) for p in sys.argv[2:]])
    else:
        main()
