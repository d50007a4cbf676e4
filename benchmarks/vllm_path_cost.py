"""What the gateway costs beside one real vLLM worker, in CPU: the gateway's and Envoy's CPU
time per request (``/proc``, all threads) while requests go straight to the worker
(``direct``: the gateway only scrapes it and reads its KV events) and while they go through
Envoy and the gateway (``through``: routed in exact mode, observed, recorded), in
alternating blocks; each block's TTFT medians; the gateway's mean decision latency.

On a CPU worker every millisecond the gateway spends is taken from the cores the engine
computes on (docs/real-model.md).

    CACHEPILOT_VLLM_VENV=.venv-vllm python benchmarks/vllm_path_cost.py [--blocks 3]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from envoy_timing import decision_latency
from extproc_throughput import cpu_seconds
from vllm_scrape_interference import ScrapeStack, document, trial

from cachepilot.tooling.vllm.stack import missing


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=3, help="direct/through block pairs")
    ap.add_argument("--trials", type=int, default=8, help="cold+warm pairs per block")
    ap.add_argument("--scrape-interval", type=float, default=1.0)
    args = ap.parse_args()
    why = missing()
    if why:
        print(why, file=sys.stderr)
        return 2
    rng = random.Random(3)
    stack = ScrapeStack(workers=1, log_dir=tempfile.mkdtemp(prefix="vllm-path-cost-"))
    stack.scrape_s = args.scrape_interval
    stack.start_workers()
    rows = []
    try:
        stack.start_router("priced", None)
        time.sleep(3.0)
        procs = stack.router_processes.procs
        gateway, envoy = procs["gateway"].pid, procs["envoy"].pid
        direct = f"http://{stack.worker_addresses[0]}"
        for block in range(2 * args.blocks):
            label, url = ("direct", direct) if block % 2 == 0 else ("through", stack.url)
            g0, e0 = cpu_seconds([gateway]), cpu_seconds([envoy])
            cold, warm = [], []
            for _ in range(args.trials):
                c, w = asyncio.run(trial(url, stack.spec.served_name, document(rng, 900), rng))
                cold.append(c)
                warm.append(w)
            n = 2 * args.trials
            rows.append((label, statistics.median(cold), statistics.median(warm),
                         1000 * (cpu_seconds([gateway]) - g0) / n,
                         1000 * (cpu_seconds([envoy]) - e0) / n))
            print(f"block {block + 1}/{2 * args.blocks} {label}", flush=True)
        latency_s, count = decision_latency(stack.admin_port)
    finally:
        stack.stop()
    print(f"\nscrape every {args.scrape_interval:g} s; {args.trials} cold+warm pairs a block\n")
    print("| block | requests | cold p50 ms | warm p50 ms | gateway CPU ms/request | "
          "Envoy CPU ms/request |\n|---|---|---:|---:|---:|---:|")
    path = {"direct": "straight to the worker", "through": "through Envoy and the gateway"}
    for label, c, w, g, e in rows:
        print(f"| {label} | {path[label]} | {c:.0f} | {w:.0f} | {g:.1f} | {e:.1f} |")
    if count:
        print(f"\ndecision latency: {1000 * latency_s / count:.2f} ms mean over "
              f"{count:.0f} decisions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
