"""Does a gateway of N processes route like one? The demo workload (``cachepilot demo``'s
CachePilot phase: 32 shared 4k-token system prompts, Poisson arrivals, workers whose KV
cache holds a third of them) through a local stack whose gateway runs one process, then
``--processes N``, in turn for ``--rounds`` rounds on fresh stacks; the workers' own
count of cached prompt tokens (token hit rate) and TTFT for each.

    python benchmarks/processes_hit_rate.py                      # 1 vs 2 processes, 3 rounds
    python benchmarks/processes_hit_rate.py --rounds 1 --duration 10     # quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from cachepilot.tooling.demo import MODEL, SEED, WORKER_KV_BLOCKS, WORKLOAD, requests
from cachepilot.tooling.loadgen import chat_body, run, summarize
from cachepilot.tooling.stack import LocalStack, StackConfig


def phase(processes: int, reqs: list[Any]) -> dict[str, Any]:
    config = StackConfig(policy="priced", model=MODEL, processes=processes,
                         worker_args=("--num-blocks", str(WORKER_KV_BLOCKS)))
    bodies = [chat_body(r, MODEL) for r in reqs]
    with LocalStack(config) as stack:
        results, wall = asyncio.run(run(stack.url, [r.arrival for r in reqs], bodies))
        return summarize(results, wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=WORKLOAD.duration)
    ap.add_argument("--rate", type=float, default=WORKLOAD.rate)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    spec = replace(WORKLOAD, duration=args.duration, rate=args.rate)
    rows: list[dict[str, Any]] = []
    for r in range(args.rounds):
        reqs = requests(spec, SEED + r)  # the same traffic for both, a new draw each round
        for n in ((1, args.processes) if r % 2 == 0 else (args.processes, 1)):
            s = phase(n, reqs)
            rows.append({"round": r, "processes": n, **{k: v for k, v in s.items()
                                                       if k != "per_worker"}})
            print(f"round {r + 1}, {n} process(es): token hit rate {s['token_hit_rate']:.3f}, "
                  f"TTFT p50 {s['ttft_p50_s'] * 1000:.0f} ms, {s['errors']} errors", flush=True)
    print("\n| processes | token hit rate (mean of rounds) | TTFT p50 ms | errors |")
    print("|---:|---:|---:|---:|")
    for n in (1, args.processes):
        mine = [x for x in rows if x["processes"] == n]
        print(f"| {n} | {np.mean([x['token_hit_rate'] for x in mine]):.3f} | "
              f"{np.mean([x['ttft_p50_s'] for x in mine]) * 1000:.0f} | "
              f"{sum(x['errors'] for x in mine)} |")
    one = np.mean([x["token_hit_rate"] for x in rows if x["processes"] == 1])
    many = np.mean([x["token_hit_rate"] for x in rows if x["processes"] == args.processes])
    print(f"\nhit rate difference: {100 * (many - one):+.1f} points")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(["python", *sys.argv]),
                                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
