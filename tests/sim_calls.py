"""Record what the simulator feeds the routing core, to replay it elsewhere."""

from __future__ import annotations

from typing import Any


def record_core_calls(sim: Any) -> list[tuple]:
    """Wrap the simulator's pool and router so every call into the core is logged, in
    order: ("metrics", addr, WorkerMetrics), ("route", request, now, Decision),
    ("first", decision_id), ("release", decision_id)."""
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
    router.first_token = lambda d: (calls.append(("first", d.id)), orig_first(d))
    router.release = lambda d: (calls.append(("release", d.id)), orig_release(d))
    return calls
