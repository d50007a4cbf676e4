"""Online calibration of the cost model from measured TTFTs, per worker.

The router prices a worker's time to first token as (see :mod:`cachepilot.core.cost`)::

    ttft ≈ base + prefill_ms_per_token × (uncached + pending prefill tokens)
                + queue_ms_per_waiting × waiting + queue_ms_per_running × running

Two of those parameters depend on the hardware and the model far more than the others: the
prefill time per token and the wait per queued request. For each worker, the calibrator fits
them to measured TTFTs by **online robust regression**: recursive least squares with
exponential forgetting (old hardware behaviour fades, ``forgetting`` ≈ 1 − 1/memory) where
each observation is weighted by **Huber's** rule, so a residual beyond ``huber_k`` robust
scales (a GC pause, a network stall, a cold start) counts linearly instead of quadratically.
Estimates are **bounded** (``prefill_bounds``, ``queue_bounds``) and only written into
:attr:`WorkerState.prefill_ms_per_token` / :attr:`WorkerState.queue_ms_per_waiting` once
enough informative observations have been seen (``warmup``); the queue term needs
observations with a non-empty queue, so a worker that never queues keeps the pool default.

It is a lifecycle plugin (:mod:`cachepilot.core.lifecycle`): register it with the router,
``Router(pools, plugins=[Calibrator()])`` (the gateway does by default; the simulator with
``Simulator(cfg, plugins=[Calibrator()])``). ``on_routed`` snapshots the chosen worker's
features, ``on_first_token`` fits them to the measured TTFT, ``on_finish`` drops a request
that never produced one. Only real first tokens carry a ``ttft_ms`` (streamed responses): a
non-streamed response's first byte comes after the whole generation.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from cachepilot.core.cost import CostModel
from cachepilot.core.decision import Decision
from cachepilot.core.lifecycle import Outcome, Plugin
from cachepilot.core.workers import WorkerState


@dataclass(frozen=True, slots=True)
class CalibrationConfig:
    prefill_bounds: tuple[float, float] = (0.002, 5.0)  # ms per prompt token
    queue_bounds: tuple[float, float] = (0.5, 10_000.0)  # ms per waiting request
    forgetting: float = 0.995  # per observation: a memory of ~200 requests
    huber_k: float = 2.0  # residuals beyond k robust scales are down-weighted
    warmup: int = 16  # observations before the prefill estimate is applied
    warmup_queued: int = 8  # observations with a non-empty queue before the queue estimate
    prior_spread: float = 10.0  # prior std of each slope, in multiples of its start
    base_spread_ms: float = 50.0  # prior std of the per-worker extra base
    max_pending: int = 100_000  # routed decisions awaiting their TTFT (oldest forgotten)


@dataclass(slots=True)
class Features:
    """What the chosen worker looked like when the request was routed."""

    worker: WorkerState
    tokens: float  # uncached prompt tokens + prefill already pending there
    waiting: float
    offset_ms: float  # the fixed part: base TTFT + decode interference of the running batch
    predicted_ms: float


@dataclass(slots=True)
class WorkerFit:
    """Robust RLS over θ = (extra base ms, prefill ms/token, queue ms/waiting) for one worker.
    The first parameter absorbs what the model's fixed base misses on this worker (network,
    the rest of the engine step a request lands in); it keeps the two priced slopes unbiased
    and is reported, not applied (the base is a pool-wide setting)."""

    theta: list[float]
    p: list[list[float]]  # covariance of θ (per unit of residual variance)
    prior_var: list[float]  # each variance is capped at its prior (no wind-up)
    scale_ms: float = 0.0  # robust residual scale (EWMA of clipped |residual|)
    n: int = 0
    n_queued: int = 0
    outliers: int = 0

    @classmethod
    def start(cls, prefill: float, queue: float, cfg: CalibrationConfig) -> WorkerFit:
        var = (cfg.base_spread_ms ** 2, (cfg.prior_spread * prefill) ** 2,
               (cfg.prior_spread * queue) ** 2)
        p = [[var[i] if i == j else 0.0 for j in range(3)] for i in range(3)]
        return cls(theta=[0.0, prefill, queue], p=p, prior_var=list(var))

    def update(self, x: tuple[float, float, float], y: float, cfg: CalibrationConfig) -> float:
        """One observation; returns the a priori residual (measured − predicted)."""
        th, p, lam = self.theta, self.p, cfg.forgetting
        r = y - sum(th[i] * x[i] for i in range(3))
        if self.scale_ms <= 0.0:
            self.scale_ms = max(1.0, abs(r))
        s = self.scale_ms
        w = 1.0 if abs(r) <= cfg.huber_k * s else cfg.huber_k * s / abs(r)
        if w < 1.0:
            self.outliers += 1
        # Robust scale: EWMA of |r| clipped at 4 scales, so one outlier moves it ≤ 20%.
        self.scale_ms = max(1e-3, 0.95 * s + 0.05 * min(abs(r), 4.0 * s))
        px = [sum(p[i][j] * x[j] for j in range(3)) for i in range(3)]
        denom = sum(x[i] * px[i] for i in range(3)) + lam * s * s / w
        k = [v / denom for v in px]
        for i in range(3):
            th[i] += k[i] * r
            for j in range(3):
                p[i][j] = (p[i][j] - k[i] * px[j]) / lam
        # No wind-up in directions the data does not excite: keep each variance ≤ its prior.
        for i in range(3):
            cap = self.prior_var[i]
            if p[i][i] > cap:
                f = math.sqrt(cap / p[i][i])
                for j in range(3):
                    p[i][j] *= f
                    p[j][i] *= f
        th[0] = min(max(th[0], -cfg.base_spread_ms * 4), cfg.base_spread_ms * 4)
        th[1] = min(max(th[1], cfg.prefill_bounds[0]), cfg.prefill_bounds[1])
        th[2] = min(max(th[2], cfg.queue_bounds[0]), cfg.queue_bounds[1])
        self.n += 1
        self.n_queued += x[2] > 0
        return r


class Calibrator(Plugin):
    """Fits each worker's prefill and queue parameters from measured TTFTs and writes them
    into the worker's :class:`WorkerState` overrides. Single-threaded, like the router."""

    def __init__(self, config: CalibrationConfig | None = None) -> None:
        self.cfg = config or CalibrationConfig()
        self.fits: dict[str, WorkerFit] = {}
        self._pending: OrderedDict[str, Features] = OrderedDict()

    # -- lifecycle ----------------------------------------------------------------------------
    def on_routed(self, decision: Decision, pool: Any) -> None:
        self.routed(decision, pool)

    def on_first_token(self, decision: Decision, ttft_ms: float | None) -> None:
        if ttft_ms is not None:
            self.observe(decision.id, ttft_ms)

    def on_finish(self, decision: Decision, outcome: Outcome) -> None:
        self.forget(decision.id)

    # -- fitting ------------------------------------------------------------------------------
    def routed(self, decision: Decision, pool: Any) -> None:
        """Snapshot the chosen worker's features, right after routing."""
        w = pool.workers.get(decision.chosen)
        if w is None:
            return
        cost: CostModel = pool.spec.cost
        c = decision.winner
        pending_before = w.pending_prefill_tokens - (decision.uncached_tokens
                                                     if decision.prefill_pending else 0)
        self._pending[decision.id] = Features(
            worker=w, tokens=float(decision.tokens - c.matched_tokens + max(0, pending_before)),
            waiting=float(c.waiting),
            offset_ms=cost.base_ttft_ms + c.running * cost.queue_ms_per_running,
            predicted_ms=c.predicted_ttft_ms)
        if decision.chosen not in self.fits:
            self.fits[decision.chosen] = WorkerFit.start(
                w.prefill_ms_per_token or cost.prefill_ms_per_token,
                w.queue_ms_per_waiting or cost.queue_ms_per_waiting, self.cfg)
        while len(self._pending) > self.cfg.max_pending:
            self._pending.popitem(last=False)

    def forget(self, decision_id: str) -> None:
        """The request failed before its first token: nothing to learn from it."""
        self._pending.pop(decision_id, None)

    def observe(self, decision_id: str, ttft_ms: float) -> float | None:
        """A measured TTFT for a routed decision: update that worker's fit and overrides.
        Returns the residual against the fit before the update (None if unknown id)."""
        f = self._pending.pop(decision_id, None)
        if f is None or not math.isfinite(ttft_ms) or ttft_ms < 0:
            return None
        fit = self.fits[f.worker.address]
        r = fit.update((1.0, f.tokens, f.waiting), ttft_ms - f.offset_ms, self.cfg)
        if fit.n >= self.cfg.warmup:
            f.worker.prefill_ms_per_token = fit.theta[1]
        if fit.n_queued >= self.cfg.warmup_queued:
            f.worker.queue_ms_per_waiting = fit.theta[2]
        return r

    def estimates(self) -> dict[str, dict[str, float]]:
        """Per worker: the fitted parameters, robust scale and observation counts."""
        return {a: {"prefill_ms_per_token": f.theta[1], "queue_ms_per_waiting": f.theta[2],
                    "extra_base_ms": f.theta[0],
                    "residual_scale_ms": f.scale_ms, "observations": f.n,
                    "queued_observations": f.n_queued, "outliers": f.outliers}
                for a, f in sorted(self.fits.items())}
