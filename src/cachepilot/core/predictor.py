"""The TTFT predictor: each worker's TTFT model, learned online from measured first tokens.

The router predicts a worker's TTFT for a request as a linear model of its features
(:class:`~cachepilot.core.cost.Features`)::

    ttft − KV pressure ≈ θ · (1, prefill tokens, running, queued)

with θ = (base ms, prefill ms/token, ms per running sequence, ms per unseen queued request),
starting from the cost model's prior. :class:`TTFTPredictor` is a lifecycle plugin
(:mod:`cachepilot.core.lifecycle`): ``on_routed`` keeps the chosen worker's features,
``on_first_token`` fits them to the measured TTFT, ``on_finish`` drops a request that never
produced one. The fit is **recursive least squares with an intercept**, one per worker, with
exponential forgetting (hardware and load drift; ``forgetting`` ≈ 1 − 1/memory) and each
observation weighted by **Huber's** rule, so a residual beyond ``huber_k`` robust scales (a
GC pause, a network stall, a cold start) counts linearly, not quadratically. The intercept
absorbs what the features leave out (HTTP, Envoy, tokenisation, the step in progress), so
the slopes stay unbiased. Parameters are bounded, and written into the worker's
:attr:`~cachepilot.core.workers.WorkerState.ttft` after ``warmup`` observations; a direction
the data never excites (a worker that never queues) keeps its prior.

Only real first tokens carry a ``ttft_ms`` (streamed responses, the simulator's engines): a
non-streamed response's first byte comes after the whole generation.

Its accuracy is a first-class figure: :meth:`TTFTPredictor.accuracy` gives, per worker and
overall, the median and p90 of |measured − predicted| (the prediction made at routing time,
before the fit saw that request), absolute and relative to the measured TTFT.

Register it with the router: ``Router(pools, plugins=[TTFTPredictor()])`` (the gateway does
by default; the simulator too, unless ``SimConfig(learn=False)``).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cachepilot.core.cost import CostModel
from cachepilot.core.decision import Decision
from cachepilot.core.lifecycle import Outcome, Plugin
from cachepilot.core.workers import TTFTParams, WorkerState

N = 4  # parameters: base, prefill per token, per running sequence, per queued request


@dataclass(frozen=True, slots=True)
class PredictorConfig:
    # Bounds of (base ms, prefill ms/token, ms per running, ms per queued).
    lower: tuple[float, ...] = (0.0, 0.002, 0.0, 0.0)
    upper: tuple[float, ...] = (10_000.0, 5.0, 100.0, 10_000.0)
    forgetting: float = 0.995  # per observation: a memory of ~200 requests
    huber_k: float = 2.0  # residuals beyond k robust scales are down-weighted
    warmup: int = 16  # observations of a worker before its fit replaces the prior
    prior_spread: float = 10.0  # prior std of each slope, in multiples of its prior value
    base_spread_ms: float = 50.0  # prior std of the base
    max_pending: int = 100_000  # routed decisions awaiting their first token (oldest dropped)
    window: int = 1000  # recent errors kept per worker for the accuracy figures


@dataclass(slots=True)
class WorkerFit:
    """Robust recursive least squares over θ for one worker."""

    theta: list[float]
    p: list[list[float]]  # covariance of θ (per unit of residual variance)
    prior_var: list[float]  # each variance is capped at its prior (no wind-up)
    scale_ms: float = 0.0  # robust residual scale (EWMA of clipped |residual|)
    n: int = 0
    outliers: int = 0

    @classmethod
    def start(cls, prior: TTFTParams, cfg: PredictorConfig) -> WorkerFit:
        theta = [prior.base_ms, prior.prefill_ms_per_token, prior.ms_per_running,
                 prior.ms_per_queued]
        var = [cfg.base_spread_ms ** 2] + [(cfg.prior_spread * max(v, 1e-3)) ** 2
                                            for v in theta[1:]]
        p = [[var[i] if i == j else 0.0 for j in range(N)] for i in range(N)]
        return cls(theta=theta, p=p, prior_var=var)

    def params(self) -> TTFTParams:
        return TTFTParams(*self.theta)

    def update(self, x: tuple[float, ...], y: float, cfg: PredictorConfig) -> float:
        """One observation; returns the a priori residual (measured − predicted)."""
        th, p, lam = self.theta, self.p, cfg.forgetting
        r = y - sum(th[i] * x[i] for i in range(N))
        if self.scale_ms <= 0.0:
            self.scale_ms = max(1.0, abs(r))
        s = self.scale_ms
        w = 1.0 if abs(r) <= cfg.huber_k * s else cfg.huber_k * s / abs(r)
        if w < 1.0:
            self.outliers += 1
        # Robust scale: EWMA of |r| clipped at 4 scales, so one outlier moves it ≤ 20 %.
        self.scale_ms = max(1e-3, 0.95 * s + 0.05 * min(abs(r), 4.0 * s))
        px = [sum(p[i][j] * x[j] for j in range(N)) for i in range(N)]
        denom = sum(x[i] * px[i] for i in range(N)) + lam * s * s / w
        k = [v / denom for v in px]
        for i in range(N):
            th[i] += k[i] * r
            for j in range(N):
                p[i][j] = (p[i][j] - k[i] * px[j]) / lam
        # No wind-up in directions the data does not excite: keep each variance ≤ its prior.
        for i in range(N):
            cap = self.prior_var[i]
            if p[i][i] > cap:
                f = math.sqrt(cap / p[i][i])
                for j in range(N):
                    p[i][j] *= f
                    p[j][i] *= f
        for i in range(N):
            th[i] = min(max(th[i], cfg.lower[i]), cfg.upper[i])
        self.n += 1
        return r


@dataclass(slots=True)
class _Routed:
    worker: WorkerState
    x: tuple[float, ...]
    kv_ms: float
    predicted_ms: float


@dataclass(slots=True)
class _Errors:
    abs_ms: deque[float]
    measured_ms: deque[float]

    @classmethod
    def new(cls, n: int) -> _Errors:
        return cls(deque(maxlen=n), deque(maxlen=n))


@dataclass
class TTFTPredictor(Plugin):
    """Learns every worker's TTFT model from measured first tokens. Single-threaded, like
    the router it is registered with."""

    cfg: PredictorConfig = field(default_factory=PredictorConfig)
    fits: dict[str, WorkerFit] = field(default_factory=dict)
    _pending: OrderedDict[str, _Routed] = field(default_factory=OrderedDict)
    _errors: dict[str, _Errors] = field(default_factory=dict)

    # -- lifecycle ----------------------------------------------------------------------------
    def on_routed(self, decision: Decision, pool: Any) -> None:
        w = pool.workers.get(decision.chosen)
        if w is None:
            return
        c = decision.winner
        # The features as priced: pending counts are those before this request was booked.
        x = (1.0, float(decision.uncached_tokens + c.pending_prefill_tokens), float(c.running),
             float(c.queued))
        self._pending[decision.id] = _Routed(w, x, c.kv_ms, c.predicted_ttft_ms)
        if decision.chosen not in self.fits:
            cost: CostModel = pool.spec.cost
            self.fits[decision.chosen] = WorkerFit.start(w.ttft or cost.ttft, self.cfg)
        while len(self._pending) > self.cfg.max_pending:
            self._pending.popitem(last=False)

    def on_first_token(self, decision: Decision, ttft_ms: float | None) -> None:
        if ttft_ms is not None:
            self.observe(decision.id, ttft_ms)

    def on_finish(self, decision: Decision, outcome: Outcome) -> None:
        self._pending.pop(decision.id, None)

    # -- fitting ------------------------------------------------------------------------------
    def observe(self, decision_id: str, ttft_ms: float) -> float | None:
        """A measured TTFT of a routed decision: score the prediction made at routing time,
        then update that worker's fit (and its model, once warmed up). Returns the fit's a
        priori residual (None for an unknown id or a value that is not a time)."""
        routed = self._pending.pop(decision_id, None)
        if routed is None or not math.isfinite(ttft_ms) or ttft_ms < 0:
            return None
        addr = routed.worker.address
        errs = self._errors.get(addr)
        if errs is None:
            errs = self._errors[addr] = _Errors.new(self.cfg.window)
        errs.abs_ms.append(abs(ttft_ms - routed.predicted_ms))
        errs.measured_ms.append(ttft_ms)
        fit = self.fits[addr]
        r = fit.update(routed.x, ttft_ms - routed.kv_ms, self.cfg)
        if fit.n >= self.cfg.warmup:
            routed.worker.ttft = fit.params()
        return r

    # -- reporting ----------------------------------------------------------------------------
    def estimates(self) -> dict[str, dict[str, float]]:
        """Per worker: the fitted parameters, robust scale and observation counts."""
        return {a: {"base_ms": f.theta[0], "prefill_ms_per_token": f.theta[1],
                    "ms_per_running": f.theta[2], "ms_per_queued": f.theta[3],
                    "residual_scale_ms": f.scale_ms, "observations": f.n,
                    "applied": f.n >= self.cfg.warmup, "outliers": f.outliers}
                for a, f in sorted(self.fits.items())}

    def accuracy(self) -> dict[str, Any]:
        """Median and p90 of |measured − predicted| TTFT over the recent window, per worker
        and over all workers: in ms and relative to the measured TTFT."""
        per = {a: _error_stats(e.abs_ms, e.measured_ms) for a, e in sorted(self._errors.items())}
        all_abs = [v for e in self._errors.values() for v in e.abs_ms]
        all_meas = [v for e in self._errors.values() for v in e.measured_ms]
        return {"workers": per, "all": _error_stats(all_abs, all_meas)}


def _error_stats(abs_ms: Any, measured_ms: Any) -> dict[str, float]:
    a = np.asarray(abs_ms, dtype=float)
    m = np.asarray(measured_ms, dtype=float)
    if not a.size:
        return {"n": 0}
    rel = a / np.maximum(m, 1e-9)
    return {"n": int(a.size),
            "abs_error_p50_ms": float(np.median(a)),
            "abs_error_p90_ms": float(np.percentile(a, 90)),
            "rel_error_p50": float(np.median(rel)),
            "rel_error_p90": float(np.percentile(rel, 90))}
