"""Where a request's milliseconds go, from Envoy's own ext_proc timing and the gateway's.

One near-instant simulated worker, the gateway (default configuration, with a decision log)
and Envoy (the generated bootstrap plus an access log carrying the ext_proc filter's
per-request timing: ``%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:...)%``). A client with
one request in flight sends ``--requests`` non-streamed requests per prompt size; per request:

* client: end to end, as the client saw it;
* envoy: Envoy's ``%DURATION%`` (first request byte in to last response byte out);
* ext_proc headers / body: from Envoy sending that message to the gateway until its answer
  (default, body-only: no headers message, the whole body is the one message and its
  answer routes; ``send_request_headers``: the headers answered at once first): what the
  ext_proc round trips cost the request, as Envoy sees them;
* routing CPU: the gateway's own ``cachepilot_decision_latency_seconds`` (parse, fingerprint,
  match, price, book), its mean over the run;
* upstream: ``x-envoy-upstream-service-time`` (Envoy to the worker and back).

    python benchmarks/envoy_timing.py [--requests 400] [--sizes 8,32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
import orjson
import yaml
from rich.console import Console
from rich.table import Table

from cachepilot.deploy.envoy import EnvoyOptions
from cachepilot.deploy.envoy import bootstrap as build_bootstrap
from cachepilot.tooling.procs import http_get, wait_http_ok
from cachepilot.tooling.stack import envoy_binary, free_port

FIELDS = ("request_header_latency_us", "request_body_call_count",
          "request_body_total_latency_us")


def access_log(path: Path) -> list[dict]:
    fmt = {"duration_ms": "%DURATION%", "upstream_ms": "%RESP(x-envoy-upstream-service-time)%",
           "request_duration_ms": "%REQUEST_DURATION%", "code": "%RESPONSE_CODE%"}
    for f in FIELDS:
        fmt[f] = f"%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:{f})%"
    return [{"name": "envoy.access_loggers.file", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
        "path": str(path), "log_format": {"json_format": fmt}}}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--sizes", default="8,32", help="prompt KB")
    args = ap.parse_args()
    console = Console()
    tmp = Path(tempfile.mkdtemp(prefix="cachepilot-timing-"))
    wport, gport, aport, lport = free_port(), free_port(), free_port(), free_port()
    worker = f"127.0.0.1:{wport}"
    cp = [sys.executable, "-m", "cachepilot"]
    procs = [subprocess.Popen(argv, stdout=open(tmp / f"{n}.log", "wb"),  # noqa: SIM115
                              stderr=subprocess.STDOUT) for n, argv in (
        ("worker", [*cp, "sim-worker", "--port", str(wport), "--speed", "100000",
                    "--num-blocks", "262144"]),
        ("gateway", [*cp, "gateway", "--listen", f"127.0.0.1:{gport}", "--admin-port",
                     str(aport), "--workers", worker, "--engine", "sim", "--decision-log",
                     str(tmp / "decisions")]))]
    cfg = build_bootstrap(EnvoyOptions(listen_address="127.0.0.1", listen_port=lport,
                                       admin_port=free_port(), ext_proc_port=gport,
                                       workers=(worker,)))
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][-1]
    logs = {}
    try:
        wait_http_ok([f"http://127.0.0.1:{aport}/readyz"], hint=f"; logs in {tmp}")
        rows = []
        for kb in (int(s) for s in args.sizes.split(",")):
            log = tmp / f"access-{kb}.log"
            hcm["typed_config"]["access_log"] = access_log(log)
            (tmp / f"envoy-{kb}.yaml").write_text(yaml.safe_dump(cfg))
            envoy = subprocess.Popen([envoy_binary(), "-c", str(tmp / f"envoy-{kb}.yaml"),
                                      "--concurrency", "1", "--disable-hot-restart", "-l",
                                      "warning"], stdout=open(tmp / f"envoy-{kb}.out", "wb"),  # noqa: SIM115
                                     stderr=subprocess.STDOUT)
            try:
                before = decision_latency(aport)
                client = asyncio.run(drive(lport, kb * 1024, args.requests))
                after = decision_latency(aport)
            finally:
                envoy.terminate()
                envoy.wait(10)
            logs[kb] = [json.loads(line) for line in log.read_text().splitlines()][5:]
            route_ms = (after[0] - before[0]) / max(1, after[1] - before[1]) * 1000
            rows.append((kb, client, logs[kb], route_ms))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
    show(console, rows)
    console.print(f"logs: {tmp}")


def decision_latency(admin_port: int) -> tuple[float, float]:
    """(sum seconds, count) of the gateway's decision-latency histogram."""
    text = http_get(f"http://127.0.0.1:{admin_port}/metrics")[1].decode()
    s = sum(float(m) for m in re.findall(
        r"^cachepilot_decision_latency_seconds_sum\{[^}]*\} (\S+)", text, re.M))
    n = sum(float(m) for m in re.findall(
        r"^cachepilot_decision_latency_seconds_count\{[^}]*\} (\S+)", text, re.M))
    return s, n


async def drive(port: int, size: int, n: int) -> np.ndarray:
    rng = random.Random(size)
    pool = "".join(rng.choices("abcdefghijklmnopqrstuvwxyz     ", k=size * 8))
    out = []
    async with aiohttp.ClientSession() as session:
        deadline = time.time() + 30
        while True:  # Envoy up?
            try:
                async with session.get(f"http://127.0.0.1:{port}/health") as r:
                    await r.read()
                    break
            except aiohttp.ClientError:
                if time.time() > deadline:
                    raise
                await asyncio.sleep(0.2)
        for i in range(n + 5):
            o = rng.randrange(len(pool) - size)
            body = orjson.dumps({"model": "sim-llama-8b", "max_tokens": 1,
                                 "prompt": f"{i} " + pool[o:o + size - 8]})
            t0 = time.perf_counter()
            async with session.post(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                    headers={"content-type": "application/json"}) as r:
                await r.read()
            if i >= 5:
                out.append((time.perf_counter() - t0) * 1000)
    return np.array(out)


def show(console: Console, rows: list) -> None:
    table = Table(title="Where the time goes, closed loop, non-streamed (ms, p50 / p99)")
    for col in ("prompt", "client e2e", "Envoy %DURATION%", "ext_proc headers",
                "ext_proc body (routes)", "routing CPU (mean)", "gRPC + wake-ups (p50)",
                "upstream", "body msgs"):
        table.add_column(col, justify="right")

    def col(log: list[dict], key: str, scale: float = 1.0) -> np.ndarray:
        return np.array([float(e[key]) * scale for e in log
                         if e.get(key) not in (None, "-", "")])

    def pp(a: np.ndarray) -> str:
        return f"{np.percentile(a, 50):.2f} / {np.percentile(a, 99):.2f}" if len(a) else "–"

    for kb, client, log, route_ms in rows:
        hdr = col(log, "request_header_latency_us", 1e-3)
        bod = col(log, "request_body_total_latency_us", 1e-3)
        both = (np.percentile(hdr, 50) if len(hdr) else 0.0) + (
            np.percentile(bod, 50) if len(bod) else 0.0)
        chunks = col(log, "request_body_call_count")
        table.add_row(f"{kb} KB", pp(client), pp(col(log, "duration_ms")), pp(hdr), pp(bod),
                      f"{route_ms:.2f}", f"{both - route_ms:.2f}", pp(col(log, "upstream_ms")),
                      f"{np.median(chunks):.0f}" if len(chunks) else "–")
    console.print(table)
    console.print("ext_proc headers / body: from Envoy sending that message to the gateway's "
                  "answer (default: the body alone, its answer routes; with a headers "
                  "message, it is answered at once first; STREAMED: the headers' answer comes "
                  "once the body is in, and each chunk is answered after it). gRPC + "
                  "wake-ups: both, less the routing CPU.")


if __name__ == "__main__":
    main()
