"""A router over three workers with fresh metrics, as most routing tests start from; synced
replicas of it."""

from __future__ import annotations

from cachepilot.core import BlockConfig, Pool, PoolSpec, Router, WorkerMetrics
from cachepilot.core.sync import ReplicaSync

WORKERS = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")
EIGHT = tuple(f"10.0.0.{i}:8000" for i in range(1, 9))


def make_router(policy: str = "priced", workers: tuple[str, ...] = WORKERS, now: float = 100.0,
                **spec: object) -> Router:
    pool = Pool(PoolSpec(policy=policy, block=BlockConfig(16, 4.0), **spec))  # type: ignore[arg-type]
    for w in workers:
        pool.upsert_worker(w)
        pool.update_metrics(w, WorkerMetrics(scraped_at=now, kv_usage=0.1))
    return Router([pool], id_prefix="t")


def synced_routers(n: int, workers: tuple[str, ...] = EIGHT) -> list[Router]:
    """``n`` routers over the same idle workers, each with its sync plugin, each having heard
    the others (as their heartbeats make them)."""
    names = [f"r{i}" for i in range(n)]
    out = []
    for name in names:
        router = make_router(workers=workers)
        sync = ReplicaSync(name)
        router.add_plugin(sync)
        for other in names:
            sync.spread.heard(other, 100.0)
        out.append(router)
    return out
