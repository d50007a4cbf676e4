"""Record what the simulator feeds the routing core, to replay it elsewhere."""

from __future__ import annotations

from typing import Any


def record_core_calls(sim: Any) -> list[tuple]:
    """Wrap the simulator's pool and router so every call into the core is logged, in
    order: ("metrics", addr, WorkerMetrics), ("route", request, now, Decision),
    ("first", decision_id, ttft_ms), ("release", decision_id, Outcome)."""
    calls: list[tuple] = []
    pool, router = sim.pool, sim.router
    orig_update, orig_route = pool.update_metrics, router.route
    orig_first, orig_release = router.first_token, router.release

    def update(addr, m, error=None):
        calls.append(("metrics", addr, m))
        return orig_update(addr, m, error)

    def route(req, now, decision_id=None):
        d = orig_route(req, now, decision_id)
        calls.append(("route", req, now, d))
        return d

    pool.update_metrics = update
    router.route = route
    def first(d, ttft_ms=None):
        calls.append(("first", d.id, ttft_ms))
        return orig_first(d, ttft_ms)

    def release(d, outcome=None):
        calls.append(("release", d.id, outcome))
        return orig_release(d, outcome)

    router.first_token = first
    router.release = release
    return calls
