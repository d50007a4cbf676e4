"""Long prompts through every router, side by side: throughput and latency under wrk.

Two simulated workers (``sim-worker --speed 1000``: near-instant), ``--kb`` KB prompts that
share a long prefix (``--bodies`` of them, each with its own short tail, 1 % of the prompt),
``wrk`` at each ``--concurrency``. Every router fronts the same two workers:

* ``envoy``: a plain Envoy, round robin (no routing decision at all);
* ``sglang``, ``vllm``: sglang-router 0.3.2 / vllm-router 0.1.17, ``cache_aware``;
* ``cachepilot``: Envoy + the gateway, its default configuration (approximate mode,
  observation on, no decision log), one process; ``cachepilot-p2``: ``--processes 2``;
* ``noop``: Envoy + a no-op Python ext_proc server (what the mechanism costs, the floor).

Interleaved: each round runs every router for ``--seconds`` in a shuffled order, ``--rounds``
rounds, so the machine's noise lands on all of them alike. Reported per router and
concurrency: requests/s over all its slices, the median of its slices' p50 and p99, errors
(non-2xx, timeouts), and the gateway's CPU per request (``/proc``, CachePilot and no-op
only), then CachePilot's throughput and median as ratios of sglang-router's.

    python benchmarks/long_prompts.py                       # 220 KB, c=20 and 150
    python benchmarks/long_prompts.py --rounds 2 --seconds 3 --concurrency 20   # quick
    python benchmarks/long_prompts.py --out docs/results/long-prompts

Needs ``wrk`` (``apt-get install wrk``) and the peers (``pip install sglang-router==0.3.2
vllm-router==0.1.17``); a missing peer is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import yaml

from cachepilot.deploy.envoy import EnvoyOptions
from cachepilot.deploy.envoy import bootstrap as build_bootstrap
from cachepilot.tooling.procs import wait_http_ok
from cachepilot.tooling.stack import envoy_binary, free_port, free_port_run

sys.path.insert(0, str(Path(__file__).parent))
from added_latency import direct_bootstrap
from extproc_throughput import cpu_seconds

MODEL = "sim-llama-8b"
ROUTERS = ("envoy", "sglang", "vllm", "cachepilot", "cachepilot-p2", "noop")
# Also available: cachepilot-noobs (routing only: gateway --no-observe-responses),
# cachepilot-logeach (Envoy's access log sends each entry at once: the default until the
# night of 2026-12-07).
PEERS = {"sglang": ("sglang-router", ["launch"], "warn", "readiness"),
         "vllm": ("vllm-router", [], "warning", "health")}

WRK_LUA = """
local bodies = {}
local paths = {%(paths)s}
init = function(args)
  for i, p in ipairs(paths) do
    local f = io.open(p, "rb"); local b = f:read("*a"); f:close()
    bodies[i] = wrk.format("POST", "/v1/completions",
                           {["Content-Type"] = "application/json"}, b)
  end
end
local n = 0
request = function()
  n = n + 1
  return bodies[(n %% #bodies) + 1]
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('WRK {"requests": %%d, "duration_us": %%d, "errors": %%d, ' ..
    '"non_2xx": %%d, "p50_us": %%d, "p90_us": %%d, "p99_us": %%d, "mean_us": %%f}\\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.mean))
end
"""


class Bench:
    """The processes of one run, each logging to its own file; stopped by their ids."""

    def __init__(self, tmp: Path, envoy_concurrency: int) -> None:
        self.tmp = tmp
        self.envoy_concurrency = envoy_concurrency
        self.procs: list[subprocess.Popen[bytes]] = []
        self.gateway_pids: dict[str, list[int]] = {}

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(argv, stdout=open(self.tmp / f"{name}.log", "wb"),  # noqa: SIM115
                             stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def envoy(self, name: str, cfg: dict[str, Any]) -> int:
        path = self.tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        self.spawn(name, [envoy_binary(), "-c", str(path), "--concurrency",
                          str(self.envoy_concurrency), "--disable-hot-restart", "-l", "error"])
        return int(cfg["static_resources"]["listeners"][0]["address"]["socket_address"][
            "port_value"])

    def router(self, name: str, workers: list[str]) -> tuple[int, list[str]]:
        """Start router ``name``; its HTTP port and the URLs that say it is ready."""
        if name == "envoy":
            return self.envoy(name, direct_bootstrap(free_port(), free_port(), *workers)), []
        if name in PEERS:
            exe, sub, quiet, health = PEERS[name]
            port = free_port()
            self.spawn(name, [str(Path(sys.executable).parent / exe), *sub, "--host",
                              "127.0.0.1", "--port", str(port), "--worker-urls",
                              *(f"http://{w}" for w in workers), "--policy", "cache_aware",
                              "--prometheus-port", str(free_port()), "--log-level", quiet])
            return port, [f"http://127.0.0.1:{port}/{health}"]
        if name == "noop":
            gport = free_port()
            p = self.spawn(name, [sys.executable, str(Path(__file__).parent / "added_latency.py"),
                                  "--serve-noop", str(gport), workers[0], "aio"])
            self.gateway_pids[name] = [p.pid]
            cfg = build_bootstrap(EnvoyOptions(
                listen_address="127.0.0.1", listen_port=free_port(), admin_port=free_port(),
                ext_proc_port=gport, workers=tuple(workers), observe_responses=False))
            return self.envoy(f"envoy-{name}", cfg), []
        processes = 2 if name.endswith("-p2") else 1
        observe = not name.endswith("-noobs")
        # "-logeach": Envoy's access log sends each entry at once, not 10 ms of them together
        # (the default until the night of 2026-12-07).
        flush = {"access_log_flush_ms": 0} if name.endswith("-logeach") else {}
        gport, aport = free_port_run(processes + (processes > 1)), free_port_run(processes)
        p = self.spawn(name, [sys.executable, "-m", "cachepilot", "gateway", "--listen",
                              f"127.0.0.1:{gport}", "--admin-port", str(aport), "--workers",
                              ",".join(workers), "--engine", "sim", "--processes",
                              str(processes), *([] if observe else ["--no-observe-responses"])])
        self.gateway_pids[name] = [p.pid]
        cfg = build_bootstrap(EnvoyOptions(
            listen_address="127.0.0.1", listen_port=free_port(), admin_port=free_port(),
            ext_proc_port=gport, workers=tuple(workers), ext_proc_processes=processes,
            observe_responses=observe, **flush))
        return self.envoy(f"envoy-{name}", cfg), [f"http://127.0.0.1:{aport + i}/readyz"
                                                  for i in range(processes)]

    def pids(self, name: str) -> list[int]:
        """A router's gateway processes (a supervisor's children included)."""
        out = []
        for pid in self.gateway_pids.get(name, []):
            out.append(pid)
            kids = Path(f"/proc/{pid}/task/{pid}/children")
            if kids.exists():
                out += [int(k) for k in kids.read_text().split()]
        return out

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


def bodies(kb: int, n: int, tmp: Path) -> list[Path]:
    """``n`` completions bodies of ``kb`` KB: one shared prefix, 1 % tail of their own."""
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyz      \n"
    size = kb * 1024
    head = "".join(rng.choices(alphabet, k=size * 99 // 100))
    out = []
    for i in range(n):
        tail = f" question {i}: " + "".join(rng.choices(alphabet, k=size // 100))
        path = tmp / f"body-{i}.json"
        path.write_bytes(orjson.dumps({"model": MODEL, "max_tokens": 1,
                                       "prompt": (head + tail)[:size]}))
        out.append(path)
    return out


def wrk(port: int, concurrency: int, seconds: float, script: Path) -> dict[str, Any]:
    threads = min(concurrency, 2)
    res = subprocess.run(["wrk", "-t", str(threads), "-c", str(concurrency), "-d",
                          f"{seconds:g}s", "--timeout", "30s", "-s", str(script),
                          f"http://127.0.0.1:{port}"], capture_output=True, text=True,
                         timeout=seconds + 60)
    line = next((x for x in res.stdout.splitlines() if x.startswith("WRK ")), None)
    if line is None:
        raise RuntimeError(f"wrk said: {res.stdout[-500:]} {res.stderr[-500:]}")
    return json.loads(line[4:])


def summarise(slices: list[dict[str, Any]]) -> dict[str, Any]:
    reqs = sum(s["requests"] for s in slices)
    secs = sum(s["duration_us"] for s in slices) / 1e6
    cpu = sum(s.get("cpu_s", 0.0) for s in slices)
    ok = reqs - sum(s["non_2xx"] for s in slices)
    return {"slices": len(slices), "requests": reqs, "rps": ok / secs if secs else 0.0,
            "p50_ms": float(np.median([s["p50_us"] for s in slices])) / 1000,
            "p99_ms": float(np.median([s["p99_us"] for s in slices])) / 1000,
            "errors": sum(s["errors"] + s["non_2xx"] for s in slices),
            "cpu_ms_per_request": cpu * 1000 / ok if ok and cpu else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kb", type=int, default=220)
    ap.add_argument("--bodies", type=int, default=8)
    ap.add_argument("--concurrency", default="20,150")
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=8.0, help="per router and round")
    ap.add_argument("--envoy-concurrency", type=int, default=2, help="Envoy worker threads")
    ap.add_argument("--out", default=None, help="write report.md, results.json, plot here")
    args = ap.parse_args()
    if not shutil.which("wrk"):
        sys.exit("needs wrk: apt-get install -y wrk")
    names = [r for r in args.routers.split(",") if r]
    for peer, (exe, *_rest) in PEERS.items():
        if peer in names and not (Path(sys.executable).parent / exe).exists():
            print(f"skipping {peer}: {exe} is not installed", file=sys.stderr)
            names.remove(peer)
    tmp = Path(tempfile.mkdtemp(prefix="cachepilot-long-"))
    bench = Bench(tmp, args.envoy_concurrency)
    script = tmp / "post.lua"
    paths = bodies(args.kb, args.bodies, tmp)
    script.write_text(WRK_LUA % {"paths": ", ".join(f'"{p}"' for p in paths)})
    workers = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    results: dict[str, Any] = {"kb": args.kb, "bodies": args.bodies, "cpus": os.cpu_count(),
                               "envoy_concurrency": args.envoy_concurrency, "cells": {}}
    try:
        for i, w in enumerate(workers):
            bench.spawn(f"worker-{i}", [sys.executable, "-m", "cachepilot", "sim-worker",
                                        "--port", w.rsplit(":", 1)[1], "--speed", "1000",
                                        "--num-blocks", "1000000"])
        ports, ready = {}, [f"http://{w}/health" for w in workers]
        for name in names:
            ports[name], urls = bench.router(name, workers)
            ready += urls
        wait_http_ok(ready, timeout_s=90, hint=f"; logs in {tmp}")
        time.sleep(2.0)
        for name in names:  # warm every path (connections, caches, directories)
            wrk(ports[name], 4, 2.0, script)
        rng = random.Random(1)
        for c in (int(x) for x in args.concurrency.split(",")):
            slices: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
            for r in range(args.rounds):
                order = list(names)
                rng.shuffle(order)
                for name in order:
                    pids = bench.pids(name)
                    cpu0 = cpu_seconds(pids) if pids else 0.0
                    s = wrk(ports[name], c, args.seconds, script)
                    if pids:
                        s["cpu_s"] = cpu_seconds(pids) - cpu0
                    slices[name].append(s)
                    print(f"c={c} round {r + 1} {name:>14}: {s['requests'] / args.seconds:7.0f}"
                          f" req/s p50 {s['p50_us'] / 1000:7.1f} ms, {s['non_2xx']} non-2xx",
                          flush=True)
            results["cells"][str(c)] = {n: {**summarise(v), "raw": v} for n, v in slices.items()}
    finally:
        bench.stop()
    report(results, names, args)
    print(f"logs: {tmp}")


def ratios(cell: dict[str, Any], name: str) -> tuple[float | None, float | None]:
    sg, me = cell.get("sglang"), cell.get(name)
    if not sg or not me or not sg["rps"]:
        return None, None
    return me["rps"] / sg["rps"], me["p50_ms"] / sg["p50_ms"]


def report(results: dict[str, Any], names: list[str], args: argparse.Namespace) -> None:
    lines = [f"# Long prompts through every router: {args.kb} KB, two fast simulated workers",
             "", f"{args.rounds} rounds of {args.seconds:g} s per router and concurrency, "
             f"interleaved; {args.bodies} prompts sharing a {args.kb * 99 // 100} KB prefix; "
             f"Envoy with {args.envoy_concurrency} worker threads; {results['cpus']} CPUs.", ""]
    for c, cell in results["cells"].items():
        lines += [f"## Concurrency {c}", "",
                  "| router | req/s | p50 ms | p99 ms | errors | gateway CPU ms/req | "
                  "÷ sglang req/s | ÷ sglang p50 |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for n in names:
            r = cell[n]
            tp, lat = ratios(cell, n)
            cpu = r["cpu_ms_per_request"]
            lines.append(f"| {n} | {r['rps']:.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
                         f"{r['errors']} | {'' if cpu is None else f'{cpu:.2f}'} | "
                         f"{'' if tp is None else f'{tp:.2f}'} | "
                         f"{'' if lat is None else f'{lat:.2f}'} |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.out:
        from cachepilot.lab.output import StudyOutput

        out = StudyOutput(Path(args.out), "python " + " ".join(sys.argv))
        out.figure(plot(results, names), "throughput.png")
        out.write(text + "\n![throughput and median](throughput.png)\n", results)


def plot(results: dict[str, Any], names: list[str]):  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = results["cells"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(cells))
    for k, (c, cell) in enumerate(cells.items()):
        xs = np.arange(len(names)) + k * width
        axes[0].bar(xs, [cell[n]["rps"] for n in names], width, label=f"c={c}")
        axes[1].bar(xs, [cell[n]["p50_ms"] for n in names], width, label=f"c={c}")
    for ax, title in zip(axes, ("requests/s", "median latency (ms)"), strict=True):
        ax.set_xticks(np.arange(len(names)) + width * (len(cells) - 1) / 2)
        ax.set_xticklabels(names, rotation=30, ha="right")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
