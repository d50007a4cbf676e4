"""Online calibration: robust recovery of the prefill and queue parameters."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from cachepilot.core import InferenceRequest, Pool, PoolSpec, Router, WorkerMetrics
from cachepilot.core.calibration import CalibrationConfig, Calibrator, WorkerFit


def synthetic(fit: WorkerFit, cfg: CalibrationConfig, n: int, *, prefill: float, queue: float,
              base: float = 7.0, outliers: float = 0.0, seed: int = 1,
              queued: bool = True) -> None:
    rng = random.Random(seed)
    for _ in range(n):
        tokens = rng.randint(50, 4000)
        waiting = rng.randint(0, 6) if queued else 0
        y = base + prefill * tokens + queue * waiting + rng.gauss(0, 5.0)
        if rng.random() < outliers:
            y += rng.choice((3000.0, 10_000.0))  # a stall: seconds, not milliseconds
        fit.update((1.0, float(tokens), float(waiting)), y, cfg)


def test_fit_recovers_parameters_from_ten_times_wrong_starts() -> None:
    cfg = CalibrationConfig()
    for start in ((0.02, 1500.0), (2.0, 10.0)):
        fit = WorkerFit.start(*start, cfg)
        synthetic(fit, cfg, 600, prefill=0.2, queue=150.0)
        base, prefill, queue = fit.theta
        assert prefill == pytest.approx(0.2, rel=0.02)
        assert queue == pytest.approx(150.0, rel=0.03)
        assert base == pytest.approx(7.0, abs=5.0)


def test_fit_is_robust_to_outliers() -> None:
    cfg = CalibrationConfig()
    fit = WorkerFit.start(0.08, 150.0, cfg)
    synthetic(fit, cfg, 800, prefill=0.2, queue=150.0, outliers=0.05, seed=3)
    assert fit.theta[1] == pytest.approx(0.2, rel=0.05)
    assert fit.theta[2] == pytest.approx(150.0, rel=0.1)
    assert fit.outliers >= 30
    # Plain least squares (an enormous Huber threshold) is dragged far off by the same data.
    naive_cfg = CalibrationConfig(huber_k=1e9)
    naive = WorkerFit.start(0.08, 150.0, naive_cfg)
    synthetic(naive, naive_cfg, 800, prefill=0.2, queue=150.0, outliers=0.05, seed=3)
    assert abs(naive.theta[1] - 0.2) > 3 * abs(fit.theta[1] - 0.2)


def test_fit_is_bounded_and_does_not_wind_up() -> None:
    cfg = CalibrationConfig(prefill_bounds=(0.01, 1.0), queue_bounds=(1.0, 500.0))
    fit = WorkerFit.start(0.08, 150.0, cfg)
    synthetic(fit, cfg, 300, prefill=40.0, queue=10_000.0)  # absurd hardware
    assert 0.9 < fit.theta[1] <= 1.0 and 400.0 < fit.theta[2] <= 500.0  # pinned at the bounds
    assert -200.0 <= fit.theta[0] <= 200.0  # the extra base is bounded too (4 × 50 ms)
    idle = WorkerFit.start(0.08, 150.0, cfg)
    synthetic(idle, cfg, 2000, prefill=0.1, queue=0.0, queued=False)
    assert idle.theta[2] == 150.0  # never excited: the queue estimate stays where it was
    assert idle.p[2][2] <= idle.prior_var[2] * (1 + 1e-9)  # and its variance is capped
    assert idle.n_queued == 0


def test_calibrator_sets_overrides_after_warmup() -> None:
    pool = Pool(PoolSpec())
    pool.upsert_worker("w1:8000")
    router = Router([pool], id_prefix="c")
    cal = Calibrator(CalibrationConfig(warmup=10, warmup_queued=5))
    rng = random.Random(5)
    w = pool.workers["w1:8000"]
    for i in range(60):
        waiting = rng.randint(0, 3)
        pool.update_metrics("w1:8000", WorkerMetrics(waiting=waiting, running=0,
                                                      scraped_at=float(i)))
        d = router.route(InferenceRequest(model="m", prompt=f"{i} " * rng.randint(100, 3000)),
                         now=float(i))
        cal.routed(d, pool)
        if i < 9:
            assert w.prefill_ms_per_token is None  # not before warm-up
        uncached = d.uncached_tokens
        router.release(d)
        ttft = 15.0 + 0.3 * uncached + 80.0 * waiting
        assert cal.observe(d.id, ttft) is not None
    assert cal.observe("unknown", 10.0) is None
    assert w.prefill_ms_per_token == pytest.approx(0.3, rel=0.05)
    assert w.queue_ms_per_waiting == pytest.approx(80.0, rel=0.1)
    est = cal.estimates()["w1:8000"]
    assert est["observations"] == 60


TRUE_PREFILL = {"10.0.0.1:8000": 0.2, "10.0.0.2:8000": 0.05, "10.0.0.3:8000": 0.12}


class Collecting(Calibrator):
    """Keeps each observation's features so predictions can be compared afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, float, float, float, float]] = []

    def observe(self, decision_id: str, ttft_ms: float) -> float | None:
        f = self._pending.get(decision_id)
        if f is not None:
            self.seen.append((f.worker.address, f.tokens, f.waiting, f.offset_ms, ttft_ms))
        return super().observe(decision_id, ttft_ms)


def run_sim(start: tuple[float, float]) -> tuple[Collecting, Any]:
    sim = pytest.importorskip("cachepilot.sim")
    from cachepilot.sim.engine import Engine, EngineConfig

    cal = Collecting()
    s = sim.Simulator(sim.SimConfig(workers=3), plugins=[cal])
    for addr, prefill in TRUE_PREFILL.items():
        # Three different GPUs; the router starts with the same, wrong, beliefs about each.
        s.workers[addr].engine = Engine(EngineConfig(prefill_ms_per_token=prefill,
                                                     max_batch=12))
        s.pool.workers[addr].prefill_ms_per_token = start[0]
        s.pool.workers[addr].queue_ms_per_waiting = start[1]
    run = s.run(sim.generate(sim.WorkloadSpec(rate=10, duration=120), 5))
    return cal, run


def _abs_err(seen: list, params: dict[str, tuple[float, float]], base: float = 0.0) -> float:
    errs = [abs(ttft - (off + base + params[a][0] * tok + params[a][1] * wait))
            for a, tok, wait, off, ttft in seen]
    return float(np.mean(errs))


def test_calibration_recovers_wrong_parameters_in_the_simulator() -> None:
    """Three workers with different prefill speeds; the router starts 10× too optimistic
    about prefill and 13× too pessimistic about queues, or the reverse. Calibration finds
    each worker's prefill rate, and its predictions beat the starting beliefs'."""
    fitted = {}
    for start in ((0.02, 2000.0), (1.0, 5.0)):
        cal, _ = run_sim(start)
        est = cal.estimates()
        assert set(est) == set(TRUE_PREFILL)
        for addr, truth in TRUE_PREFILL.items():
            assert est[addr]["prefill_ms_per_token"] == pytest.approx(truth, rel=0.3), addr
            assert est[addr]["queued_observations"] >= 20
        fitted[start] = est
        late = cal.seen[len(cal.seen) // 2:]
        now = {a: (e["prefill_ms_per_token"], e["queue_ms_per_waiting"]) for a, e in est.items()}
        wrong = dict.fromkeys(est, start)
        assert _abs_err(late, now) < 0.5 * _abs_err(late, wrong)
    # From opposite starts, the queue estimates land in the same place.
    a, b = fitted.values()
    for addr in TRUE_PREFILL:
        qa, qb = a[addr]["queue_ms_per_waiting"], b[addr]["queue_ms_per_waiting"]
        assert 0.5 < qa / qb < 2.0, (addr, qa, qb)
