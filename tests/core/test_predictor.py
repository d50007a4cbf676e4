"""The TTFT predictor: robust online recovery of each worker's TTFT model, and its accuracy."""

from __future__ import annotations

import random

import numpy as np
import pytest

from cachepilot.core import InferenceRequest, Pool, PoolSpec, Router, WorkerMetrics
from cachepilot.core.cost import CostModel
from cachepilot.core.predictor import PredictorConfig, TTFTPredictor, WorkerFit
from cachepilot.core.workers import TTFTParams

TRUE = TTFTParams(base_ms=60.0, prefill_ms_per_token=0.2, ms_per_running=1.5,
                  ms_per_queued=150.0, ms_per_batch_wait=600.0)


def synthetic(fit: WorkerFit, cfg: PredictorConfig, n: int, *, truth: TTFTParams = TRUE,
              outliers: float = 0.0, seed: int = 1, queued: bool = True) -> None:
    rng = random.Random(seed)
    for _ in range(n):
        waiting = rng.randint(0, 6) if queued else 0
        full = queued and rng.random() < 0.2  # now and then behind a full batch
        x = (1.0, float(rng.randint(50, 4000)), float(rng.randint(0, 40)), float(waiting),
             float(waiting + 1 if full else 0))
        y = truth.predict(x) + rng.gauss(0, 5.0)
        if rng.random() < outliers:
            y += rng.choice((3000.0, 10_000.0))  # a stall: seconds, not milliseconds
        fit.update(x, y, cfg)


def test_fit_recovers_every_parameter_with_its_intercept_from_wrong_starts() -> None:
    """A constant the features leave out (HTTP, Envoy, tokenisation) lands in the intercept,
    not in the slopes: the slopes come back unbiased from priors off by 10× either way."""
    cfg = PredictorConfig()
    for prior in (TTFTParams(15.0, 0.02, 0.2, 1500.0, 6000.0),
                  TTFTParams(15.0, 2.0, 0.02, 15.0, 60.0)):
        fit = WorkerFit.start(prior, cfg)
        synthetic(fit, cfg, 1500)
        got = fit.params()
        assert got.prefill_ms_per_token == pytest.approx(0.2, rel=0.02)
        assert got.ms_per_queued == pytest.approx(150.0, rel=0.03)
        assert got.ms_per_batch_wait == pytest.approx(600.0, rel=0.03)
        assert got.ms_per_running == pytest.approx(1.5, abs=0.3)
        assert got.base_ms == pytest.approx(60.0, abs=8.0)


def test_fit_is_robust_to_outliers() -> None:
    cfg = PredictorConfig()
    prior = CostModel().ttft
    fit = WorkerFit.start(prior, cfg)
    synthetic(fit, cfg, 1500, outliers=0.05, seed=3)
    assert fit.theta[1] == pytest.approx(0.2, rel=0.05)
    assert fit.theta[3] == pytest.approx(150.0, rel=0.1)
    assert fit.outliers >= 10  # of the last 400, ~5 % are stalls
    # Plain least squares (an enormous Huber threshold) is dragged far off by the same data.
    naive_cfg = PredictorConfig(huber_k=1e9)
    naive = WorkerFit.start(prior, naive_cfg)
    synthetic(naive, naive_cfg, 1500, outliers=0.05, seed=3)
    assert abs(naive.theta[1] - 0.2) > 3 * abs(fit.theta[1] - 0.2)


def test_fit_is_bounded_and_keeps_its_prior_where_the_data_says_nothing() -> None:
    cfg = PredictorConfig(upper=(10_000.0, 1.0, 100.0, 500.0, 100_000.0))
    fit = WorkerFit.start(CostModel().ttft, cfg)
    synthetic(fit, cfg, 300, truth=TTFTParams(60.0, 40.0, 1.0, 10_000.0))  # absurd hardware
    assert fit.theta[1] == pytest.approx(1.0)  # pinned at its bound
    assert all(lo <= v <= hi for lo, v, hi in zip(cfg.lower, fit.theta, cfg.upper,
                                                   strict=True))
    idle = WorkerFit.start(CostModel().ttft, cfg)
    synthetic(idle, cfg, 2000, queued=False)
    assert idle.theta[3] == pytest.approx(CostModel().queue_ms_per_waiting)  # never excited
    assert idle.theta[4] == pytest.approx(CostModel().full_batch_wait_ms)


def test_the_plugin_learns_a_workers_model_after_warmup_and_scores_itself() -> None:
    pool = Pool(PoolSpec())
    pool.upsert_worker("w1:8000")
    predictor = TTFTPredictor(PredictorConfig(warmup=10))
    router = Router([pool], id_prefix="c", plugins=[predictor])
    rng = random.Random(5)
    w = pool.workers["w1:8000"]
    truth = TTFTParams(40.0, 0.3, 0.0, 80.0)
    for i in range(400):
        waiting = rng.randint(0, 3)
        pool.update_metrics("w1:8000", WorkerMetrics(waiting=waiting, running=0,
                                                      scraped_at=float(i)))
        d = router.route(InferenceRequest(model="m", prompt=f"{i} " * rng.randint(100, 3000)),
                         now=float(i))
        if i < 9:
            assert w.ttft is None  # the prior until warm-up
        c = d.winner
        router.first_token(d, truth.predict((1.0, d.uncached_tokens + c.ahead_tokens, 0.0,
                                             c.queued, c.batch_waits)))
        router.release(d)
    assert predictor.observe("unknown", 10.0) is None
    assert w.ttft is not None
    assert w.ttft.prefill_ms_per_token == pytest.approx(0.3, rel=0.05)
    assert w.ttft.ms_per_queued == pytest.approx(80.0, rel=0.1)
    assert w.ttft.base_ms == pytest.approx(40.0, abs=10.0)
    assert predictor.estimates()["w1:8000"]["observations"] == 400
    acc = predictor.accuracy()
    assert acc["all"]["n"] == 400 and acc["workers"]["w1:8000"]["n"] == 400
    # The recent window was predicted after the model had learned: errors are small.
    assert acc["all"]["rel_error_p50"] < 0.05


def test_a_request_that_never_answers_teaches_nothing() -> None:
    pool = Pool(PoolSpec())
    pool.upsert_worker("w1:8000")
    pool.update_metrics("w1:8000", WorkerMetrics(scraped_at=0.0))
    predictor = TTFTPredictor()
    router = Router([pool], plugins=[predictor])
    d = router.route(InferenceRequest(model="m", prompt="x " * 500), now=0.0)
    router.release(d)  # failed before its first token
    router.first_token(d, 10.0)  # a late report after the end changes nothing
    assert predictor.accuracy()["all"]["n"] == 0 and predictor.fits["w1:8000"].n == 0


TRUE_PREFILL = {"10.0.0.1:8000": 0.2, "10.0.0.2:8000": 0.05, "10.0.0.3:8000": 0.12}


def test_the_simulator_learns_each_engines_speed_and_predicts_within_15_percent() -> None:
    """Three different GPUs; the router starts with the same, wrong, beliefs about each."""
    from cachepilot.sim import SimConfig, Simulator, WorkloadSpec, generate
    from cachepilot.sim.engine import Engine, EngineConfig

    s = Simulator(SimConfig(workers=3))
    for addr, prefill in TRUE_PREFILL.items():
        s.workers[addr].engine = Engine(EngineConfig(prefill_ms_per_token=prefill))
    run = s.run(generate(WorkloadSpec(rate=10, duration=120), 5))
    assert s.predictor is not None
    est = s.predictor.estimates()
    for addr, truth in TRUE_PREFILL.items():
        assert est[addr]["prefill_ms_per_token"] == pytest.approx(truth, rel=0.3), addr
    late = run.results[len(run.results) // 2:]
    rel = [abs(o.ttft_s - o.predicted_ttft_s) / o.ttft_s for o in late if o.ttft_s]
    assert float(np.median(rel)) < 0.15


def test_a_bursts_unexplained_seconds_do_not_set_the_model_of_the_short_requests_after_it() -> None:
    """A full batch makes requests wait for a finishing sequence: a second that no feature
    explains. Fitted with equal weights, a burst of those skews the slopes and the next
    30-50 ms requests are predicted 25 % off (bursty's 20 % median error); weighted by
    the inverse of their TTFT (their noise grows with it), they stay within 12 %."""
    cfg = PredictorConfig()
    fit = WorkerFit.start(CostModel().ttft, cfg)
    rng = random.Random(7)

    def quiet() -> tuple[tuple[float, ...], float]:
        x = (1.0, float(rng.randint(50, 300)), float(rng.randint(5, 40)), 0.0, 0.0)
        return x, 12.0 + 0.08 * x[1] + 0.1 * x[2] + rng.uniform(0.0, 10.0)  # + step phase

    for _ in range(150):
        fit.update(*quiet(), cfg)
    for _ in range(120):
        # The batch size unknown: no feature says these wait for a finishing sequence.
        x = (1.0, float(rng.randint(1500, 4000)), 64.0, float(rng.randint(8, 16)), 0.0)
        fit.update(x, rng.uniform(800.0, 1200.0), cfg)
    rel = []
    for _ in range(150):
        x, y = quiet()
        rel.append(abs(fit.update(x, y, cfg)) / y)  # the a priori residual
    assert float(np.median(rel)) < 0.12


def test_a_worker_without_observations_starts_from_its_pools_model() -> None:
    pool = Pool(PoolSpec())
    for a in ("w1:8000", "w2:8000"):
        pool.upsert_worker(a)
        pool.update_metrics(a, WorkerMetrics(scraped_at=0.0))
    predictor = TTFTPredictor(PredictorConfig(warmup=10))
    router = Router([pool], id_prefix="p", plugins=[predictor])
    truth = TTFTParams(40.0, 0.3, 0.0, 80.0)
    rng = random.Random(2)
    for i in range(60):
        d = router.route(InferenceRequest(model="m", prompt=f"{i} " * rng.randint(100, 2000)),
                         now=0.0)
        if d.chosen != "w1:8000":  # only w1 answers
            router.release(d)
            continue
        c = d.winner
        router.first_token(d, truth.predict((1.0, d.uncached_tokens + c.ahead_tokens, 0.0,
                                             c.queued, c.batch_waits)))
        router.release(d)
    w2 = pool.workers["w2:8000"]
    assert predictor.fits.get("w2:8000") is None or predictor.fits["w2:8000"].n == 0
    assert w2.ttft is not None  # the pool's model, not the cost model's prior
    assert w2.ttft.prefill_ms_per_token == pytest.approx(0.3, rel=0.1)


def _train(predictor: TTFTPredictor, pool: Pool, truth: TTFTParams, n: int) -> None:
    router = Router([pool], id_prefix="s", plugins=[predictor])
    rng = random.Random(7)
    for i in range(n):
        now = float(i)
        for a in pool.workers:
            pool.update_metrics(a, WorkerMetrics(waiting=0, running=0, scraped_at=now))
        d = router.route(InferenceRequest(model="m", prompt=f"{now} " * rng.randint(100, 3000)),
                         now=now)
        c = d.winner
        router.first_token(d, truth.predict((1.0, d.uncached_tokens + c.ahead_tokens, 0.0,
                                             c.queued, c.batch_waits)))
        router.release(d)


def test_a_restarted_predictor_starts_from_what_the_last_one_learned() -> None:
    """state() → JSON → restore(): the pool's fit comes back as it was, and the workers of
    the pool (new addresses, as after a restart) predict with it from the pool's first
    routed request on; a predictor without it keeps the prior for its warm-up."""
    import orjson

    truth = TTFTParams(120.0, 3.5, 0.0, 80.0)
    old_pool = Pool(PoolSpec())
    old_pool.upsert_worker("10.0.0.1:8000")
    learned = TTFTPredictor()
    _train(learned, old_pool, truth, 60)
    state = orjson.loads(orjson.dumps(learned.state()))

    def restarted(with_state: bool) -> Pool:
        """A new pool, one request routed (no first token yet: nothing learned anew)."""
        pool = Pool(PoolSpec())
        for a in ("10.0.1.1:8000", "10.0.1.2:8000"):
            pool.upsert_worker(a)
            pool.update_metrics(a, WorkerMetrics(waiting=0, running=0, scraped_at=1000.0))
        predictor = TTFTPredictor()
        if with_state:
            predictor.restore(state)
            assert predictor.pooled["default"].params() == learned.pooled["default"].params()
        Router([pool], plugins=[predictor]).route(InferenceRequest(model="m", prompt="x " * 300),
                                                  now=1000.0)
        return pool

    warm = restarted(True)
    for w in warm.workers.values():
        assert w.ttft is not None
        assert w.ttft.prefill_ms_per_token == pytest.approx(3.5, rel=0.05)
        assert w.ttft.base_ms == pytest.approx(120.0, abs=20.0)
    cold = restarted(False)
    assert all(w.ttft is None for w in cold.workers.values())  # the prior, for its warm-up


@pytest.mark.parametrize("bad, why", [
    ({"version": 99, "pools": {}}, "version"),
    ({"version": 1, "pools": {"default": {"theta": [1.0, 2.0]}}}, "not a predictor fit"),
    ({"version": 1, "pools": {"default": {
        "theta": [1.0] * 5, "prior": [1.0] * 5, "prior_sd": [1.0] * 5, "n": 1,
        "xs": [[1.0] * 5], "ys": [float("nan")], "ws": [1.0], "scale": 0.0,
        "scale_ms": 0.0}}}, "non-finite"),
    ([1, 2, 3], "version"),
])
def test_a_state_that_is_not_one_is_refused_with_what_is_wrong(bad: object, why: str) -> None:
    predictor = TTFTPredictor()
    with pytest.raises(ValueError, match=why):
        predictor.restore(bad)  # type: ignore[arg-type]
    assert predictor.pooled == {}
