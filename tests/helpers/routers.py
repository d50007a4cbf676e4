"""A router over three workers with fresh metrics, as most routing tests start from."""

from __future__ import annotations

from cachepilot.core import BlockConfig, Pool, PoolSpec, Router, WorkerMetrics

WORKERS = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")


def make_router(policy: str = "priced", workers: tuple[str, ...] = WORKERS, now: float = 100.0,
                **spec: object) -> Router:
    pool = Pool(PoolSpec(policy=policy, block=BlockConfig(16, 4.0), **spec))  # type: ignore[arg-type]
    for w in workers:
        pool.upsert_worker(w)
        pool.update_metrics(w, WorkerMetrics(scraped_at=now, kv_usage=0.1))
    return Router([pool], id_prefix="t")
