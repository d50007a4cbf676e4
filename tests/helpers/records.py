"""A router and its decisions for the decision-log tests, importable by a writer process a
test starts (and kills) as well as by the tests."""

from __future__ import annotations

from cachepilot.core import Decision, InferenceRequest, Pool, PoolSpec, Router, WorkerMetrics


def make_router(workers: int = 3) -> tuple[Router, Pool]:
    pool = Pool(PoolSpec())
    for i in range(workers):
        addr = f"10.0.0.{i + 1}:8000"
        pool.upsert_worker(addr)
        pool.update_metrics(addr, WorkerMetrics(waiting=i, running=2, kv_usage=0.2 * i,
                                                num_blocks=2000, scraped_at=0.0))
    return Router([pool], id_prefix="t"), pool


def route(router: Router, n: int, prompt: str = "shared system prompt " * 40) -> list[Decision]:
    out = []
    for i in range(n):
        d = router.route(InferenceRequest(model="m", prompt=prompt + f" user {i % 7}" * 10),
                         now=1.0 + i / 1000)
        router.release(d)
        out.append(d)
    return out
