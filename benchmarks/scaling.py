"""How the gateway's cost grows: with the prompt, the workers, the directory, the processes.

The gateway's ext_proc service is driven by the Envoy-shaped gRPC driver of
``extproc_throughput.py`` (a routing stream with the whole body, then, as Envoy's default
bootstrap does for an answer that is not streamed, an access log entry at its end, sent
with the others of 10 ms), without Envoy, against fake idle vLLM workers (one process
answers every worker's ``/metrics``). Five sweeps, each printed as a table (the first four
plotted too):

* **prompt size** (1 KB … 1 MB): the routing answer's latency (closed loop, one request in
  flight; p50) and the gateway's CPU per request (``/proc``, all its threads), for the
  gateway in approximate mode (its default), a no-op Python ext_proc server handling the
  same body (the design's floor), the no-op server taking an observing stream for each
  request too (the floor of ``--observe-until end``, which observes every response whole,
  the default until 2026-12-07), with ``--routing-only`` the gateway without observation,
  with ``--logged`` the gateway recording every decision (``--decision-log``), and, with
  ``--tokenizer``, exact mode (``--vllm-hash-seed 0``); prompts share a long prefix (a
  document, then a tail of their own);
* **streamed responses**: CPU per request against the response body messages each
  observing stream carries (``--response-chunks``) when observed whole (``--observe-until
  end``), gateway and no-op floor;
* **workers** (2 … 256) at ``--workers-kb``;
* **directory size**: memory per million blocks, and match / insert time against a
  directory of that size (in process);
* **gateway processes** (``--processes`` 1 … N): requests/s with ``--inflight`` requests in
  flight, and CPU per request.

    python benchmarks/scaling.py                              # everything, ~10 minutes
    python benchmarks/scaling.py --quick                      # a short run
    python benchmarks/scaling.py --out docs/results/scaling --tokenizer path/tokenizer.json
    git worktree add /tmp/before <rev> && python benchmarks/scaling.py --sweeps prompts \
        --before /tmp/before/src       # a change's before/after, interleaved
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from cachepilot.tooling.procs import wait_http_ok
from cachepilot.tooling.stack import free_port, free_port_run

sys.path.insert(0, str(Path(__file__).parent))
from extproc_throughput import Driver, cpu_seconds, wait_port

HERE = Path(__file__).parent
# The prompt sweep's servers: the no-op floor on the routing stream alone and with the
# observing stream too, the gateway (approximate mode), without its observing stream, exact.
KINDS = ["noop", "noop+observe", "before", "approximate", "routing-only", "logged", "exact"]
OBSERVED = {"noop+observe", "before", "approximate", "logged", "exact"}
MODEL = "m"


def prompts(kb: float, n: int, seed: int = 0) -> list[bytes]:
    """``n`` completions bodies of ``kb`` KB: 4 documents (95 % of the prompt), then a
    tail of their own."""
    rng = random.Random(seed)
    size = max(64, int(kb * 1024))
    words = ["the", "a", "cache", "prefix", "model", "token", "router", "gateway",
             "engine", "block", "hash", "of", "and", "to"]

    def text(chars: int) -> str:
        out = " ".join(rng.choice(words) for _ in range(chars // 4 + 1))
        return out[:chars]

    docs = [text(size * 95 // 100) for _ in range(4)]
    return [orjson.dumps({"model": MODEL, "max_tokens": 1,
                          "prompt": docs[i % 4] + f" q{i} " + text(size // 20)})
            for i in range(n)]


class Procs:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None
              ) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(argv, stdout=open(self.tmp / f"{name}.log", "wb"),  # noqa: SIM115
                             stderr=subprocess.STDOUT, env=env)
        self.procs.append(p)
        return p

    def stop(self, procs: list[subprocess.Popen[bytes]] | None = None) -> None:
        for p in procs if procs is not None else self.procs:
            p.terminate()
        for p in procs if procs is not None else self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
            if p in self.procs:
                self.procs.remove(p)


def family(p: subprocess.Popen[bytes]) -> list[int]:
    """A process and its children (a supervisor's gateway processes)."""
    kids = Path(f"/proc/{p.pid}/task/{p.pid}/children")
    return [p.pid, *(int(k) for k in kids.read_text().split())] if kids.exists() else [p.pid]


def start_server(procs: Procs, kind: str, workers: list[str], args: argparse.Namespace,
                 processes: int = 1) -> tuple[subprocess.Popen[bytes], list[int]]:
    """A gateway (``approximate`` or ``exact``) or the ``noop`` server; its ext_proc ports
    (a gateway of N processes: each one's own)."""
    if kind.startswith("noop"):
        port = free_port()
        p = procs.spawn(f"noop-{port}", [sys.executable, str(HERE / "added_latency.py"),
                                        "--serve-noop", str(port), workers[0], "aio"])
        wait_port(port)
        return p, [port]
    gport = free_port_run(processes + (processes > 1))
    aport = free_port_run(processes)
    # Each kind's flags over approximate mode: without observation, recording every decision
    # and outcome, exact.
    extra = {"routing-only": ["--no-observe-responses"],
             "logged": ["--decision-log", str(procs.tmp / f"decisions-{gport}")],
             "exact": ["--tokenizer", str(args.tokenizer), "--vllm-hash-seed", "0"],
             }.get(kind, [])
    # before: approximate mode run from another source tree (--before), for a change's
    # before/after in one interleaved run.
    env = (dict(os.environ, PYTHONPATH=str(Path(args.before).resolve()))
           if kind == "before" else None)
    p = procs.spawn(f"{kind}-{gport}", [
        sys.executable, "-m", "cachepilot", "gateway", "--listen", f"127.0.0.1:{gport}",
        "--admin-port", str(aport), "--workers", ",".join(workers), "--engine", "vllm",
        "--processes", str(processes), *extra], env=env)
    wait_http_ok([f"http://127.0.0.1:{aport + i}/readyz" for i in range(processes)],
                 timeout_s=90, hint=f"; logs in {procs.tmp}")
    ports = [gport] if processes == 1 else [gport + 1 + i for i in range(processes)]
    for port in ports:
        wait_port(port)
    time.sleep(1.0 if processes == 1 else 2.0)  # scrapes; the processes connect
    return p, ports


async def closed_loop(ports: list[int], pids: list[int], bodies: list[bytes], n: int,
                      observe: bool, inflight: int = 1, response_chunks: int = 1,
                      until_first_token: bool = True) -> dict[str, Any]:
    """``n`` requests, ``inflight`` at a time: routing-answer latency, rate, CPU/request;
    observed as the default bootstrap does (``until_first_token``; these answers are not
    streamed, so an access log entry alone ends each), or whole with ``response_chunks``
    body messages."""
    drv = Driver(ports, observe=observe, response_chunks=response_chunks,
                 until_first_token=until_first_token)
    for b in bodies[:min(20, len(bodies))]:
        await drv.one(b)
    while drv.pending:
        await asyncio.sleep(0.01)
    lat: list[float] = []
    errors = 0
    it = iter(range(n))

    async def worker() -> None:
        nonlocal errors
        for i in it:
            ms, ok = await drv.one(bodies[i % len(bodies)])
            if ok:
                lat.append(ms)
            else:
                errors += 1

    cpu0, t0 = cpu_seconds(pids), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(inflight)))
    while drv.pending:
        await asyncio.sleep(0.01)
    wall = time.perf_counter() - t0
    cpu = cpu_seconds(pids) - cpu0
    await drv.close()
    return {"n": len(lat), "errors": errors, "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99)), "rps": len(lat) / wall,
            "cpu_ms_per_request": cpu * 1000 / max(1, len(lat))}


def interleaved(procs: Procs, workers: list[str], args: argparse.Namespace,
                kinds: list[str], cells: list[Any],
                measure: Callable[[Any, str, tuple[subprocess.Popen[bytes], list[int]]],
                                  dict[str, Any] | None]) -> list[dict]:
    """One server of each kind, measured cell by cell, ``args.repeats`` rounds of every kind
    in turn per cell (machine noise lands on every kind alike); ``measure`` returns a row,
    or None for a cell a kind skips."""
    servers = {k: start_server(procs, k, workers, args) for k in kinds}
    rows = []
    try:
        for cell in cells:
            for _ in range(args.repeats):
                for kind in kinds:
                    row = measure(cell, kind, servers[kind])
                    if row is not None:
                        rows.append(row)
    finally:
        procs.stop([p for p, _ in servers.values()])
    return rows


def sweep_prompts(procs: Procs, workers: list[str], args: argparse.Namespace) -> list[dict]:
    kinds = (["noop", "noop+observe", "approximate"]
             + (["before"] if args.before else [])
             + (["routing-only"] if args.routing_only else [])
             + (["logged"] if args.logged else [])
             + (["exact"] if args.tokenizer else []))
    bodies = {kb: prompts(kb, 64) for kb in args.sizes}

    def measure(kb: float, kind: str, server: tuple[subprocess.Popen[bytes], list[int]]
                ) -> dict[str, Any] | None:
        if kind == "exact" and kb > args.exact_max_kb:
            return None
        n = args.requests if kb <= 256 else max(40, args.requests // 4)
        r = asyncio.run(closed_loop(server[1], family(server[0]), bodies[kb], n,
                                    observe=kind in OBSERVED))
        print(f"  prompt {kb:>6g} KB {kind:>12}: p50 {r['p50_ms']:7.2f} ms, "
              f"{r['cpu_ms_per_request']:6.2f} CPU ms/req", flush=True)
        return {"kb": kb, "kind": kind, **r}

    return interleaved(procs, workers, args, kinds, args.sizes, measure)


def sweep_workers(procs: Procs, all_workers: list[str], args: argparse.Namespace
                  ) -> list[dict]:
    rows = []
    bodies = prompts(args.workers_kb, 64)
    for nw in args.worker_counts:
        p, ports = start_server(procs, "approximate", all_workers[:nw], args)
        try:
            r = asyncio.run(closed_loop(ports, family(p), bodies, args.requests, observe=True))
        finally:
            procs.stop([p])
        rows.append({"workers": nw, **r})
        print(f"  {nw:>4} workers: p50 {r['p50_ms']:7.2f} ms, "
              f"{r['cpu_ms_per_request']:6.2f} CPU ms/req", flush=True)
    return rows


def sweep_responses(procs: Procs, workers: list[str], args: argparse.Namespace
                    ) -> list[dict]:
    """CPU per request against the number of response body messages the observing stream
    carries (a streamed answer's events), for the gateway and the no-op floor taking the
    same observing streams."""
    bodies = prompts(args.responses_kb, 64)

    def measure(chunks: int, kind: str, server: tuple[subprocess.Popen[bytes], list[int]]
                ) -> dict[str, Any]:
        r = asyncio.run(closed_loop(server[1], family(server[0]), bodies, args.requests,
                                    observe=True, response_chunks=chunks,
                                    until_first_token=False))
        print(f"  {chunks:>4} response messages {kind:>12}: "
              f"{r['cpu_ms_per_request']:6.2f} CPU ms/req", flush=True)
        return {"chunks": chunks, "kind": kind, **r}

    return interleaved(procs, workers, args, ["noop+observe", "approximate"],
                       args.response_chunks, measure)


def sweep_processes(procs: Procs, workers: list[str], args: argparse.Namespace) -> list[dict]:
    rows = []
    bodies = prompts(args.processes_kb, 64)
    for n in args.process_counts:
        p, ports = start_server(procs, "approximate", workers, args, processes=n)
        try:
            r = asyncio.run(closed_loop(ports, family(p), bodies, args.requests * 2,
                                        observe=True, inflight=args.inflight))
        finally:
            procs.stop([p])
        rows.append({"processes": n, **r})
        print(f"  {n} processes: {r['rps']:7.0f} req/s with {args.inflight} in flight, "
              f"p50 {r['p50_ms']:.2f} ms, {r['cpu_ms_per_request']:.2f} CPU ms/req", flush=True)
    return rows


def directory_rows(args: argparse.Namespace) -> list[dict]:
    """Memory per million blocks and match / insert time at that size, in process."""
    from cachepilot.core.directory import PrefixDirectory
    from cachepilot.core.fingerprint import chain_hashes

    rows = []
    for millions in args.directory_millions:
        total = int(millions * 1_000_000)
        workers = [f"w{i}" for i in range(4)]
        chains = [chain_hashes(i.to_bytes(8, "little") * 128 * 8, 8, i)
                  for i in range(total // 1024)]  # 1,024-block chains of their own
        gc.collect()
        tracemalloc.start()
        d = PrefixDirectory(default_capacity=total)
        for w in workers:
            d.add_worker(w)
        for i, c in enumerate(chains):
            d.insert(workers[i % 4], c)
        mem = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        probe = chains[len(chains) // 2]
        t0 = time.perf_counter()
        for _ in range(200):
            d.match(probe, workers, chained=True)
        match_us = (time.perf_counter() - t0) / 200 * 1e6
        t0 = time.perf_counter()
        for c in chains[:200]:
            d.insert(workers[0], c)
        insert_us = (time.perf_counter() - t0) / 200 * 1e6
        rows.append({"blocks": d.distinct_blocks(), "bytes": mem,
                     "bytes_per_million": mem / (d.distinct_blocks() / 1e6),
                     "match_us_1024_blocks": match_us, "insert_us_1024_blocks": insert_us})
        print(f"  directory of {d.distinct_blocks():,} blocks: {mem / 2**20:.0f} MiB "
              f"({mem / d.distinct_blocks():.0f} B/block); match {match_us:.0f} µs, insert "
              f"{insert_us:.0f} µs a 1,024-block prompt", flush=True)
        del d, chains
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,8,64,220,1024", help="prompt KB")
    ap.add_argument("--worker-counts", default="2,16,64,256")
    ap.add_argument("--workers-kb", type=float, default=8)
    ap.add_argument("--process-counts", default="1,2")
    ap.add_argument("--processes-kb", type=float, default=220)
    ap.add_argument("--inflight", type=int, default=16, help="processes sweep")
    ap.add_argument("--directory-millions", default="0.25,1")
    ap.add_argument("--requests", type=int, default=300, help="per cell")
    ap.add_argument("--repeats", type=int, default=2, help="prompt sweep rounds, interleaved")
    ap.add_argument("--tokenizer", default=None, help="tokenizer.json: exact mode too")
    ap.add_argument("--routing-only", action="store_true",
                    help="also approximate mode without observation (what it costs)")
    ap.add_argument("--logged", action="store_true",
                    help="also approximate mode with a decision log (what recording costs)")
    ap.add_argument("--before", default=None, metavar="SRC",
                    help="also approximate mode from this source tree (e.g. a git worktree's "
                         "src/ at an older commit), interleaved: a change's before/after")
    ap.add_argument("--exact-max-kb", type=float, default=220)
    ap.add_argument("--response-chunks", default="1,16,128",
                    help="responses sweep: body messages per observed response")
    ap.add_argument("--responses-kb", type=float, default=8)
    ap.add_argument("--sweeps", default="prompts,responses,workers,directory,processes")
    ap.add_argument("--quick", action="store_true", help="few requests, small sweeps")
    ap.add_argument("--out", default=None, help="report.md, results.json and PNGs here")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.repeats = 60, 1
        args.worker_counts, args.directory_millions = "2,64", "0.25"
    args.sizes = [float(x) for x in args.sizes.split(",")]
    args.worker_counts = [int(x) for x in args.worker_counts.split(",")]
    args.process_counts = [int(x) for x in args.process_counts.split(",")]
    args.response_chunks = [int(x) for x in args.response_chunks.split(",")]
    args.directory_millions = [float(x) for x in args.directory_millions.split(",")]
    sweeps = args.sweeps.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="cachepilot-scaling-"))
    procs = Procs(tmp)
    ports = [free_port() for _ in range(max(args.worker_counts))]
    workers = [f"127.0.0.1:{p}" for p in ports]
    procs.spawn("metrics", [sys.executable, str(HERE / "extproc_throughput.py"),
                            "--serve-metrics", *map(str, ports)])
    results: dict[str, Any] = {"cpus": os.cpu_count(), "load_average": os.getloadavg()}
    try:
        wait_http_ok([f"http://{w}/metrics" for w in workers[:2]], timeout_s=30)
        if "prompts" in sweeps:
            print("prompt size:")
            results["prompts"] = sweep_prompts(procs, workers[:2], args)
        if "responses" in sweeps:
            print("observed response messages:")
            results["responses"] = sweep_responses(procs, workers[:2], args)
        if "workers" in sweeps:
            print("workers:")
            results["workers"] = sweep_workers(procs, workers, args)
        if "directory" in sweeps:
            print("directory:")
            results["directory"] = directory_rows(args)
        if "processes" in sweeps:
            print("gateway processes:")
            results["processes"] = sweep_processes(procs, workers[:2], args)
    finally:
        procs.stop()
        results["load_average_after"] = os.getloadavg()
    write(results, args)
    print(f"logs: {tmp}")


def _median_by(rows: list[dict], keys: tuple[str, ...], field: str) -> dict[tuple, float]:
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r[field])
    return {k: float(np.median(v)) for k, v in groups.items()}


def write(results: dict[str, Any], args: argparse.Namespace) -> None:
    lines = ["# How the gateway's cost grows", "",
             f"{results['cpus']} CPUs; load average {results['load_average'][0]:.1f} before, "
             f"{results['load_average_after'][0]:.1f} after (figures from a shared machine "
             "are inflated alike; read the ratios).", ""]
    if "prompts" in results:
        rows = results["prompts"]
        kinds = sorted({r["kind"] for r in rows},
                       key=KINDS.index)
        lat = _median_by(rows, ("kb", "kind"), "p50_ms")
        cpu = _median_by(rows, ("kb", "kind"), "cpu_ms_per_request")
        floors = [("approximate", "noop"), ("approximate", "noop+observe"),
                  ("before", "noop"), ("approximate", "before"),
                  ("routing-only", "noop"), ("logged", "approximate")]
        floors = [(a, b) for a, b in floors if a in kinds and b in kinds]
        lines += ["## Prompt size", "", "Routing answer p50 (ms) / gateway CPU per request "
                  "(ms). `approximate`: the gateway as Envoy's default bootstrap drives it "
                  "(these answers are not streamed: the routing stream, then an access log "
                  "entry, sent with the others of 10 ms as Envoy now does, no observing "
                  "stream); `noop`: the no-op server on the routing stream "
                  "alone; `noop+observe`: it also takes an observing stream per request (and "
                  "answers nothing), as `--observe-until end` sends it (the default until "
                  "2026-12-07); `routing-only`: the gateway without observation; `logged`: the "
                  "gateway recording every decision and outcome (`--decision-log`)"
                  + (f"; `before`: approximate mode from `{args.before}` (`--before`)"
                     if args.before else "") + ". The ratios are CPU over CPU.", "",
                  "| KB | " + " | ".join(kinds) + " | "
                  + " | ".join(f"{a} ÷ {b}" for a, b in floors) + " |",
                  "|---:|" + "---:|" * (len(kinds) + len(floors))]
        for kb in args.sizes:
            cells = [f"{lat[(kb, k)]:.2f} / {cpu[(kb, k)]:.2f}" if (kb, k) in lat else ""
                     for k in kinds]
            cells += [f"{cpu[(kb, a)] / cpu[(kb, b)]:.2f}" for a, b in floors]
            lines.append(f"| {kb:g} | " + " | ".join(cells) + " |")
        lines.append("")
    if "responses" in results:
        rows = results["responses"]
        cpu = _median_by(rows, ("chunks", "kind"), "cpu_ms_per_request")
        chunks = sorted({r["chunks"] for r in rows})
        lines += ["## Streamed responses", "", f"{args.responses_kb:g} KB prompts; each "
                  "observed response's body in this many messages (a streamed answer's "
                  "events, the last with its usage), as Envoy's observing filter passes them "
                  "on. Gateway CPU per request (ms); the slope is the CPU each further "
                  "message costs (least squares over the counts).", "",
                  "| messages | noop+observe | approximate | approximate − noop+observe |",
                  "|---:|---:|---:|---:|"]
        for c in chunks:
            a, b = cpu[(c, "approximate")], cpu[(c, "noop+observe")]
            lines.append(f"| {c} | {b:.2f} | {a:.2f} | {a - b:+.2f} |")
        for kind in ("noop+observe", "approximate"):
            slope = np.polyfit(chunks, [cpu[(c, kind)] for c in chunks], 1)[0]
            lines.append(f"\n{kind}: {slope * 1000:.0f} µs of CPU per further message.")
        lines.append("")
    if "workers" in results:
        lines += ["## Workers", "", f"{args.workers_kb:g} KB prompts.", "",
                  "| workers | p50 ms | CPU ms/request |", "|---:|---:|---:|"]
        lines += [f"| {r['workers']} | {r['p50_ms']:.2f} | {r['cpu_ms_per_request']:.2f} |"
                  for r in results["workers"]]
        lines.append("")
    if "directory" in results:
        lines += ["## Directory size", "", "| blocks | MiB | bytes per million blocks | match "
                  "µs | insert µs (1,024-block prompt) |", "|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['blocks']:,} | {r['bytes'] / 2**20:.0f} | "
                  f"{r['bytes_per_million'] / 2**20:.0f} MiB | {r['match_us_1024_blocks']:.0f} |"
                  f" {r['insert_us_1024_blocks']:.0f} |" for r in results["directory"]]
        lines.append("")
    if "processes" in results:
        base = results["processes"][0]["rps"]
        lines += ["## Gateway processes", "", f"{args.processes_kb:g} KB prompts, "
                  f"{args.inflight} requests in flight (the driver shares the machine).", "",
                  "| processes | req/s | × one | p50 ms | CPU ms/request |",
                  "|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['processes']} | {r['rps']:.0f} | {r['rps'] / base:.2f} | "
                  f"{r['p50_ms']:.2f} | {r['cpu_ms_per_request']:.2f} |"
                  for r in results["processes"]]
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.out:
        from cachepilot.lab.output import StudyOutput

        out = StudyOutput(Path(args.out), "python " + " ".join(sys.argv))
        out.figure(plot(results, args), "scaling.png")
        out.write(text + "\n![how cost grows](scaling.png)\n", results)


def plot(results: dict[str, Any], args: argparse.Namespace):  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    if "prompts" in results:
        ax = axes[0][0]
        rows = results["prompts"]
        for kind in sorted({r["kind"] for r in rows}):
            cpu = _median_by([r for r in rows if r["kind"] == kind], ("kb",),
                             "cpu_ms_per_request")
            lat = _median_by([r for r in rows if r["kind"] == kind], ("kb",), "p50_ms")
            xs = sorted(k[0] for k in cpu)
            ax.plot(xs, [cpu[(x,)] for x in xs], marker="o", label=f"{kind}: CPU ms/req")
            ax.plot(xs, [lat[(x,)] for x in xs], marker="x", ls="--",
                    label=f"{kind}: p50 ms")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("prompt KB")
        ax.set_title("cost against prompt size")
        ax.legend(fontsize=7)
    if "workers" in results:
        ax = axes[0][1]
        rows = results["workers"]
        ax.plot([r["workers"] for r in rows], [r["cpu_ms_per_request"] for r in rows],
                marker="o", label="CPU ms/req")
        ax.plot([r["workers"] for r in rows], [r["p50_ms"] for r in rows], marker="x",
                ls="--", label="p50 ms")
        ax.set_xscale("log")
        ax.set_xlabel("workers")
        ax.set_title(f"cost against workers ({args.workers_kb:g} KB)")
        ax.legend(fontsize=7)
    if "directory" in results:
        ax = axes[1][0]
        rows = results["directory"]
        ax.plot([r["blocks"] / 1e6 for r in rows], [r["bytes"] / 2**20 for r in rows],
                marker="o")
        ax.set_xlabel("million blocks")
        ax.set_ylabel("MiB")
        ax.set_title("directory memory")
    if "processes" in results:
        ax = axes[1][1]
        rows = results["processes"]
        ax.bar([str(r["processes"]) for r in rows], [r["rps"] for r in rows])
        ax.set_xlabel("gateway processes")
        ax.set_ylabel("requests/s")
        ax.set_title(f"throughput against processes ({args.processes_kb:g} KB)")
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
