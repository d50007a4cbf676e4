"""Does a gateway of N processes route like one? The demo workload (``cachepilot demo``'s
CachePilot phase: 32 shared 4k-token system prompts, Poisson arrivals, workers whose KV
cache holds a third of them) through a local stack whose gateway runs one process, then
``--processes N``, in turn for ``--rounds`` rounds on fresh stacks; the workers' own
count of cached prompt tokens (token hit rate) and TTFT for each.

    python benchmarks/processes_hit_rate.py                      # 1 vs 2 processes, 3 rounds
    python benchmarks/processes_hit_rate.py --rounds 1 --duration 10     # quick

``--envoy NAME=A,B`` compares two values of one of Envoy's options (``EnvoyOptions``; one
process) the same way instead: ``--envoy access_log_flush_ms=0,10``, the access log's entries
each at once against 10 ms of them together.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from cachepilot.deploy.envoy import EnvoyOptions
from cachepilot.tooling.demo import MODEL, SEED, WORKER_KV_BLOCKS, WORKLOAD, requests
from cachepilot.tooling.loadgen import chat_body, run, summarize
from cachepilot.tooling.stack import LocalStack, StackConfig


def phase(processes: int, reqs: list[Any], envoy: dict[str, Any] | None = None
          ) -> dict[str, Any]:
    config = StackConfig(policy="priced", model=MODEL, processes=processes,
                         worker_args=("--num-blocks", str(WORKER_KV_BLOCKS)),
                         envoy=envoy or {})
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
    ap.add_argument("--envoy", default=None, metavar="NAME=A,B",
                    help="compare two values of an Envoy option (one process) instead")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    spec = replace(WORKLOAD, duration=args.duration, rate=args.rate)
    arms = envoy_arms(args.envoy, args.processes)
    label = "processes" if args.envoy is None else args.envoy.split("=", 1)[0]
    rows: list[dict[str, Any]] = []
    for r in range(args.rounds):
        reqs = requests(spec, SEED + r)  # the same traffic for both, a new draw each round
        for name, n, envoy in (arms if r % 2 == 0 else arms[::-1]):
            s = phase(n, reqs, envoy)
            rows.append({"round": r, label: name, **{k: v for k, v in s.items()
                                                    if k != "per_worker"}})
            print(f"round {r + 1}, {label} {name}: token hit rate {s['token_hit_rate']:.3f}, "
                  f"TTFT p50 {s['ttft_p50_s'] * 1000:.0f} ms, p90 "
                  f"{s['ttft_p90_s'] * 1000:.0f} ms, {s['errors']} errors", flush=True)
    print(f"\n| {label} | token hit rate (mean of rounds) | TTFT p50 ms | TTFT p90 ms | errors |")
    print("|---:|---:|---:|---:|---:|")
    for name, _, _ in arms:
        mine = [x for x in rows if x[label] == name]
        print(f"| {name} | {np.mean([x['token_hit_rate'] for x in mine]):.3f} | "
              f"{np.mean([x['ttft_p50_s'] for x in mine]) * 1000:.0f} | "
              f"{np.mean([x['ttft_p90_s'] for x in mine]) * 1000:.0f} | "
              f"{sum(x['errors'] for x in mine)} |")
    first, second = ([np.mean([x["token_hit_rate"] for x in rows if x[label] == name])
                      for name, _, _ in arms])
    print(f"\nhit rate difference: {100 * (second - first):+.1f} points")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(["python", *sys.argv]),
                                               "rows": rows}, indent=1))


def envoy_arms(envoy: str | None, processes: int) -> list[tuple[str, int, dict[str, Any]]]:
    """The two arms: (name, processes, Envoy options)."""
    if envoy is None:
        return [("1", 1, {}), (str(processes), processes, {})]
    name, _, values = envoy.partition("=")
    if name not in {f.name for f in fields(EnvoyOptions)}:
        raise SystemExit(f"--envoy: {name!r} is not one of EnvoyOptions' fields")
    a, _, b = values.partition(",")
    try:
        return [(v, 1, {name: int(v)}) for v in (a, b)]
    except ValueError:
        raise SystemExit(f"--envoy wants NAME=A,B with two integers, not {envoy!r}") from None


if __name__ == "__main__":
    main()
