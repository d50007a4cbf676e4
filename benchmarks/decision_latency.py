"""Decision latency: parse + fingerprint + directory match + price + pick, as the gateway does
per request, by prompt size and worker count; then decisions/s on one core at 64 workers.

    python benchmarks/decision_latency.py [--quick]
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np
import orjson
from rich.console import Console
from rich.table import Table

from cachepilot.core import (
    BlockConfig,
    Pool,
    PoolSpec,
    Router,
    WorkerMetrics,
    parse_openai_body,
)

PATH = "/v1/chat/completions"


def make_router(n_workers: int, now: float) -> Router:
    pool = Pool(PoolSpec(block=BlockConfig(16, 4.0), capacity_blocks=8192))
    rng = random.Random(1)
    for i in range(n_workers):
        addr = f"10.0.{i // 250}.{i % 250}:8000"
        pool.upsert_worker(addr)
        pool.update_metrics(addr, WorkerMetrics(waiting=rng.randint(0, 3),
                                                running=rng.randint(0, 32),
                                                kv_usage=rng.random() * 0.9, num_blocks=8192,
                                                scraped_at=now))
    return Router([pool], id_prefix="bench")


def bodies(tokens: int, groups: int, n: int, seed: int = 0) -> list[bytes]:
    """Chat bodies: one of ``groups`` shared documents (~90% of the prompt) + a unique tail."""
    rng = random.Random(seed)
    chars = tokens * 4
    docs = [f"doc{g} " + "".join(rng.choices("abcdefghij ", k=int(chars * 0.9)))
            for g in range(groups)]
    return [orjson.dumps({"model": "m", "messages": [
        {"role": "system", "content": rng.choice(docs)},
        {"role": "user", "content": "".join(rng.choices("klmnop ", k=int(chars * 0.1)))}]})
        for _ in range(n)]


def measure(router: Router, reqs: list[bytes], now: float) -> np.ndarray:
    out = np.empty(len(reqs))
    for i, raw in enumerate(reqs):
        t0 = time.perf_counter()
        d = router.route(parse_openai_body(PATH, raw), now)
        out[i] = time.perf_counter() - t0
        router.release(d)
    return out * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer requests per cell")
    args = ap.parse_args()
    n = 100 if args.quick else 400
    now = time.time()
    console = Console()
    table = Table(title="Decision latency (µs): parse + fingerprint + match + price + pick")
    table.add_column("prompt tokens", justify="right")
    workers = (3, 16, 64)
    for w in workers:
        table.add_column(f"{w} workers p50 / p99", justify="right")
    for tokens in (1024, 4096, 8192, 32768):
        reqs = bodies(tokens, groups=32, n=n + 50)
        row = [f"{tokens:,}"]
        for w in workers:
            router = make_router(w, now)
            measure(router, reqs[n:], now)  # warm the directory
            lat = measure(router, reqs[:n], now)
            row.append(f"{np.percentile(lat, 50):,.0f} / {np.percentile(lat, 99):,.0f}")
        table.add_row(*row)
    console.print(table)
    for tokens in (1024, 8192):
        router = make_router(64, now)
        reqs = bodies(tokens, groups=64, n=2000 if not args.quick else 500, seed=3)
        t0 = time.process_time()
        measure(router, reqs, now)
        cpu = time.process_time() - t0
        console.print(f"decisions/s on one core, 64 workers, {tokens:,}-token prompts: "
                      f"[bold]{len(reqs) / cpu:,.0f}[/] (target ≥ 2,000)")


if __name__ == "__main__":
    main()
