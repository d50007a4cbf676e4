"""What a router costs beside two idle llama.cpp workers, in CPU: the share of one core each
process uses (``/proc``, all threads) while no request flows, for CachePilot (gateway and
Envoy) at each scrape interval given and for sglang-router, in alternating rounds. The
workers' own share counts too: llama-server answers ``/metrics`` and ``/slots`` from the loop
that runs inference. On a 2-core machine with a single-threaded worker per core, whatever a
router takes comes out of the prefills (docs/real-model.md).

    python benchmarks/llama_idle_cpu.py [--rounds 3] [--seconds 30] [--intervals 0.25,1]
    python benchmarks/llama_idle_cpu.py --intervals 1 --log-off   # what the decision log costs
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from extproc_throughput import cpu_seconds

from cachepilot.tooling import llamacpp
from cachepilot.tooling.llamacpp import LlamaStack
from cachepilot.tooling.llamacpp.routers import ROUTERS


def idle_share(stack: LlamaStack, seconds: float) -> dict[str, float]:
    """Percent of one core each process of the stack used over ``seconds`` of quiet."""
    time.sleep(3.0)  # past the start-up's own scrapes and calibration
    pids = {name: proc.pid for name, proc in stack.processes.procs.items()}
    before, t0 = {n: cpu_seconds([p]) for n, p in pids.items()}, time.monotonic()
    time.sleep(seconds)
    dt = time.monotonic() - t0
    return {n: 100.0 * (cpu_seconds([p]) - before[n]) / dt for n, p in pids.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=30.0, help="quiet time measured")
    ap.add_argument("--intervals", default="0.25,1",
                    help="CachePilot's scrape intervals (s) to compare")
    ap.add_argument("--log-off", action="store_true",
                    help="also CachePilot without a decision log, at the last interval")
    args = ap.parse_args()
    why = llamacpp.installed()
    if why:
        print(f"llama.cpp not installed: {why}", file=sys.stderr)
        return 2
    setups: list[tuple[str, dict]] = [
        (f"cachepilot, scrape every {s:g} s", {"scrape_interval_s": s})
        for s in map(float, args.intervals.split(","))]
    if args.log_off:
        last = float(args.intervals.split(",")[-1])
        setups.append((f"cachepilot, scrape every {last:g} s, no decision log",
                       {"scrape_interval_s": last, "decision_log": False}))
    setups.append(("sglang-router", {"peer": ROUTERS["sglang_cache_aware"]}))
    shares: dict[str, list[dict[str, float]]] = {name: [] for name, _ in setups}
    for r in range(args.rounds):
        for name, kw in setups:
            with LlamaStack(workers=2, **kw) as stack:
                got = idle_share(stack, args.seconds)
            shares[name].append(got)
            print(f"round {r + 1}/{args.rounds} {name}: "
                  + ", ".join(f"{n} {v:.2f} %" for n, v in got.items()), flush=True)
    print("\n| router | workers (both) | router's processes | total, % of one core |")
    print("|---|---:|---:|---:|")
    for name, rounds in shares.items():
        workers = statistics.median(sum(v for n, v in g.items() if n.startswith("llama-"))
                                    for g in rounds)
        router = statistics.median(sum(v for n, v in g.items() if not n.startswith("llama-"))
                                   for g in rounds)
        print(f"| {name} | {workers:.2f} | {router:.2f} | {workers + router:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
