"""The TTFT predictor: each worker's TTFT model, learned online from measured first tokens.

The router predicts a worker's TTFT for a request as a linear model of its features
(:func:`~cachepilot.core.cost.ahead_of`)::

    ttft − KV pressure ≈ θ · (1, prefill tokens, running, queued, full-batch waits)

with θ = (base ms, prefill ms/token, ms per running sequence, ms per queued request, ms per
place in line behind a full batch),
starting from the cost model's prior. :class:`TTFTPredictor` is a lifecycle plugin
(:mod:`cachepilot.core.lifecycle`): ``on_routed`` keeps the chosen worker's features,
``on_first_token`` fits them to the measured TTFT, ``on_finish`` drops a request that never
produced one. The fit is **weighted least squares with an intercept**, one per worker, over
its last ``memory`` observations (hardware and load drift). Each observation weighs the inverse
of its TTFT (a TTFT's noise grows with it: equal weights let a burst's few second-long waits
set the model of every 30 ms request after them), times **Huber's** weight so a residual
beyond ``huber_k`` robust scales (a GC pause, a network stall, a cold start) counts linearly,
not quadratically (:class:`WorkerFit`). Each worker's prior is its pool's fit (every worker's
observations) once that is warm, loosely (``pool_spread``): identical workers do not drift
apart on noise, a worker with a different GPU soon overrules it, and a worker with no
observations yet starts from the pool's model instead of the cost model's prior. The
intercept absorbs what the features leave out (HTTP, Envoy, tokenisation, the step in
progress), so the slopes stay unbiased. Parameters are bounded, and written into the worker's
:attr:`~cachepilot.core.workers.WorkerState.ttft` after ``warmup`` observations; a direction
the data never excite (a worker that never queues) keeps its prior.

Only real first tokens carry a ``ttft_ms`` (streamed responses, the simulator's engines): a
non-streamed response's first byte comes after the whole generation.

Its accuracy is a first-class figure: :meth:`TTFTPredictor.accuracy` gives, per worker and
overall, the median and p90 of |measured − predicted| (the prediction made at routing time,
before the fit saw that request), absolute and relative to the measured TTFT.

Register it with the router: ``Router(pools, plugins=[TTFTPredictor()])`` (the gateway does
by default; the simulator too, unless ``SimConfig(learn=False)``). A restart need not start
from the prior: :meth:`TTFTPredictor.state` is each pool's fit as JSON, which the gateway
saves and reads back (``--predictor-state``), so its workers start from what the last run
learned instead of spending their warm-up on the prior.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# np.median imports numpy.ma at its first call: ~30 ms in the gateway's event loop at the
# first first token. Imported here, with the rest of start-up.
import numpy.ma

from cachepilot.core.cost import CostModel
from cachepilot.core.decision import Decision
from cachepilot.core.lifecycle import Outcome, Plugin
from cachepilot.core.workers import TTFTParams, WorkerState

N = 5  # parameters: base, prefill per token, per running, per queued, per full-batch wait
STATE_VERSION = 1  # of TTFTPredictor.state()


@dataclass(frozen=True, slots=True)
class PredictorConfig:
    # Bounds of (base ms, prefill ms/token, ms per running, ms per queued, ms per batch wait).
    lower: tuple[float, ...] = (0.0, 0.002, 0.0, 0.0, 0.0)
    upper: tuple[float, ...] = (10_000.0, 5.0, 100.0, 10_000.0, 100_000.0)
    memory: int = 400  # observations per worker the fit uses (older ones age out)
    refit_every: int = 16  # observations between refits (a refit is ~0.2 ms of numpy)
    huber_k: float = 1.0  # residuals beyond k robust scales are down-weighted
    # An observation weighs 1 / TTFT^weight_power: a TTFT's noise grows with it (each step
    # waited through adds its own phase and length), its variance about in proportion. With
    # equal weights a burst's few one-second waits, which no feature explains (a full batch
    # waits for a finishing sequence), set the model of the hundreds of 30 ms requests after
    # it, over-predicting them 2-4× for the rest of a run. 0: plain least squares.
    weight_power: float = 1.0
    floor_ms: float = 1.0  # a TTFT below this weighs as much as one of this
    min_scale: float = 0.01  # weighted residual scale assumed before the first refit
    irls_rounds: int = 3
    warmup: int = 16  # observations of a worker before its fit replaces the prior
    prior_spread: float = 10.0  # prior std of each slope, in multiples of its prior value
    base_spread_ms: float = 50.0  # prior std of the base
    # Once its pool's fit (every worker's observations) is warm, a worker's prior is that
    # fit, with this std relative to each parameter: workers of a pool usually run the same
    # hardware, so noise alone should not set their models apart; a different GPU's data
    # overrule it within a few dozen observations.
    pool_spread: float = 0.25
    max_pending: int = 100_000  # routed decisions awaiting their first token (oldest dropped)
    window: int = 1000  # recent errors kept per worker for the accuracy figures


@dataclass(slots=True)
class WorkerFit:
    """Robust, bounded least squares over θ for one worker, on its last ``memory``
    observations, refitted every ``refit_every``.

    Each refit is iteratively reweighted least squares with Huber weights (robust scale:
    the residuals' MAD), a ridge pull towards the prior (weak where the data speak, decisive
    where they do not) and the bounds kept by an active set: a parameter that would leave
    its bounds is fixed there and the others refitted without it. Clipping after an
    unconstrained update instead (as a recursive filter would) lets the free parameters
    compensate for the clipped one's intended move, and the fit drifts."""

    prior: np.ndarray
    prior_sd: np.ndarray
    theta: np.ndarray
    xs: np.ndarray  # ring buffer of the last ``memory`` feature rows…
    ys: np.ndarray  # …their targets…
    ws: np.ndarray  # …and their weights (PredictorConfig.weight_power)
    scale: float = 0.0  # robust scale of the weighted residuals in the last refit
    scale_ms: float = 0.0  # robust residual scale of the last refit in ms (1.4826 × MAD)
    n: int = 0
    outliers: int = 0  # observations down-weighted in the last refit

    @classmethod
    def start(cls, prior: TTFTParams, cfg: PredictorConfig) -> WorkerFit:
        p = np.array([prior.base_ms, prior.prefill_ms_per_token, prior.ms_per_running,
                      prior.ms_per_queued, prior.ms_per_batch_wait])
        sd = np.concatenate(([cfg.base_spread_ms], cfg.prior_spread * np.maximum(p[1:], 1e-3)))
        return cls(prior=p, prior_sd=sd, theta=p.copy(), xs=np.zeros((cfg.memory, N)),
                   ys=np.zeros(cfg.memory), ws=np.ones(cfg.memory))

    def params(self) -> TTFTParams:
        return TTFTParams(*(float(v) for v in self.theta))

    def to_state(self) -> dict[str, Any]:
        """The fit as plain lists and numbers: its parameters, prior and the observations
        behind them (the ring buffer's filled rows)."""
        k = min(self.n, len(self.ys))
        return {"theta": self.theta.tolist(), "prior": self.prior.tolist(),
                "prior_sd": self.prior_sd.tolist(), "n": self.n, "xs": self.xs[:k].tolist(),
                "ys": self.ys[:k].tolist(), "ws": self.ws[:k].tolist(),
                "scale": self.scale, "scale_ms": self.scale_ms}

    @classmethod
    def from_state(cls, state: Mapping[str, Any], cfg: PredictorConfig) -> WorkerFit:
        """The fit :meth:`to_state` described (ValueError saying what is wrong otherwise),
        counting the observations it kept; those beyond this config's ``memory`` are
        dropped."""
        try:
            vec = {k: np.asarray(state[k], dtype=float) for k in ("theta", "prior", "prior_sd")}
            rows = np.asarray(state["xs"], dtype=float).reshape(-1, N)[-cfg.memory:]
            ys = np.asarray(state["ys"], dtype=float)[-cfg.memory:]
            ws = np.asarray(state["ws"], dtype=float)[-cfg.memory:]
            n, scale, scale_ms = int(state["n"]), float(state["scale"]), float(state["scale_ms"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"not a predictor fit: {err}") from None
        arrays = (*vec.values(), rows, ys, ws)
        if any(v.shape != (N,) for v in vec.values()) or not len(rows) == len(ys) == len(ws) \
                or not all(np.isfinite(a).all() for a in arrays) or n < len(ys):
            raise ValueError("not a predictor fit: wrong shapes, counts or non-finite values")
        k = len(ys)
        fit = cls(prior=vec["prior"], prior_sd=vec["prior_sd"], theta=vec["theta"],
                  xs=np.zeros((cfg.memory, N)), ys=np.zeros(cfg.memory),
                  ws=np.ones(cfg.memory), scale=scale, scale_ms=scale_ms, n=k)
        fit.xs[:k], fit.ys[:k], fit.ws[:k] = rows, ys, ws
        return fit

    def center_on(self, pool: WorkerFit, cfg: PredictorConfig) -> None:
        """Take the pool's fit as this worker's prior (floors: 1 ms, 0.001 per unit)."""
        self.prior = pool.theta.copy()
        floor = np.array([1.0, 1e-3, 1e-3, 1e-3, 1e-3])
        self.prior_sd = cfg.pool_spread * np.maximum(np.abs(self.prior), floor)

    def update(self, x: tuple[float, ...], y: float, cfg: PredictorConfig,
               measured_ms: float | None = None) -> float:
        """One observation (``measured_ms``: its TTFT, when ``y`` is not all of it); returns
        its a priori residual (measured − predicted)."""
        th = self.theta
        r = y - (th[0] * x[0] + th[1] * x[1] + th[2] * x[2] + th[3] * x[3] + th[4] * x[4])
        i = self.n % len(self.ys)
        self.xs[i] = x
        self.ys[i] = y
        ttft = y if measured_ms is None else measured_ms
        self.ws[i] = 1.0 / max(ttft, cfg.floor_ms) ** cfg.weight_power
        self.n += 1
        if self.n % cfg.refit_every == 0 or self.n == cfg.warmup:
            self.refit(cfg)
        return float(r)

    def refit(self, cfg: PredictorConfig) -> None:
        k = min(self.n, len(self.ys))
        x, y, base = self.xs[:k], self.ys[:k], self.ws[:k]
        w = base
        lo, hi = np.asarray(cfg.lower), np.asarray(cfg.upper)
        scale = max(self.scale, cfg.min_scale)
        theta = self.theta
        for _ in range(cfg.irls_rounds):
            # The prior is weighed against weighted residuals, so in their units.
            ridge = (scale / self.prior_sd) ** 2
            theta = _bounded_ridge(x, y, w, ridge, self.prior, lo, hi)
            r = np.abs(y - x @ theta) * np.sqrt(base)
            scale = max(1.4826 * float(np.median(r)), 1e-6)
            w = base * np.where(r <= cfg.huber_k * scale, 1.0,
                                cfg.huber_k * scale / np.maximum(r, 1e-12))
        self.theta, self.scale = theta, scale
        self.scale_ms = 1.4826 * float(np.median(np.abs(y - x @ theta)))
        self.outliers = int(np.sum(w < base))


def _bounded_ridge(x: np.ndarray, y: np.ndarray, w: np.ndarray, ridge: np.ndarray,
                   prior: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """argmin Σ w (y − xθ)² + Σ ridge (θ − prior)² within [lo, hi], by an active set."""
    xw = x.T * w
    a = xw @ x
    a[np.diag_indices_from(a)] += ridge
    b = xw @ y + ridge * prior
    sol = np.linalg.solve(a, b)
    if np.all(sol >= lo) and np.all(sol <= hi):  # the usual case: no bound binds
        return sol
    theta = np.clip(prior, lo, hi)
    free = np.ones(len(prior), dtype=bool)
    for _ in range(len(prior)):
        fixed = ~free
        rhs = b[free] - a[np.ix_(free, fixed)] @ theta[fixed]
        sol = np.linalg.solve(a[np.ix_(free, free)], rhs)
        out = (sol < lo[free]) | (sol > hi[free])
        theta[free] = np.clip(sol, lo[free], hi[free])
        if not out.any():
            break
        idx = np.flatnonzero(free)[out]
        free[idx] = False
        if not free.any():
            break
    return theta


@dataclass(slots=True)
class _Routed:
    pool: Any  # the Pool the decision was made in
    worker: WorkerState
    x: tuple[float, ...]
    kv_ms: float
    predicted_ms: float  # the decision's own prediction (what accuracy() scores)
    waited_ms: float = 0.0  # held for the busy worker since x was priced (added to y)


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
    pooled: dict[str, WorkerFit] = field(default_factory=dict)  # by pool name
    _pending: OrderedDict[str, _Routed] = field(default_factory=OrderedDict)
    _errors: dict[str, _Errors] = field(default_factory=dict)
    _restored: set[str] = field(default_factory=set)  # pools whose model is not applied yet

    # -- across restarts ----------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """What a restarted gateway needs to predict as this one does: each pool's fit (every
        worker's observations), JSON-ready. Workers' own fits are not kept: their addresses
        change across restarts, and their own data soon accumulate again on top of their
        pool's model."""
        return {"version": STATE_VERSION,
                "pools": {name: f.to_state() for name, f in sorted(self.pooled.items())}}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Start from a :meth:`state` (ValueError saying what is wrong if it is not one). A
        warm pool's model becomes its workers' from the pool's first routed request on."""
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION \
                or not isinstance(state.get("pools"), Mapping):
            raise ValueError(f"not a predictor state of version {STATE_VERSION}")
        pooled = {str(name): WorkerFit.from_state(f, self.cfg)
                  for name, f in state["pools"].items()}
        self.pooled.update(pooled)
        self._restored |= {name for name, f in pooled.items() if f.n >= self.cfg.warmup}

    # -- lifecycle ----------------------------------------------------------------------------
    def on_routed(self, decision: Decision, pool: Any) -> None:
        if pool.name in self._restored:  # once: the restored model for its workers
            self._restored.discard(pool.name)
            self._share_pool_model(pool)
        w = pool.workers.get(decision.chosen)
        if w is None:
            return
        c, waited = decision.winner, 0.0
        uncached = decision.uncached_tokens
        if decision.holder_priced is not None and decision.holder_priced.worker == w.address:
            # Held for this busy worker, then sent to it once free: an observation of the
            # wait as priced when it began (the measured TTFT plus the time held since).
            c, waited = decision.holder_priced, decision.holder_waited_ms
            uncached = decision.tokens - c.matched_tokens
        # The features exactly as priced (before this request was booked).
        x = (1.0, float(uncached + c.ahead_tokens), float(c.running),
             float(c.queued), float(c.batch_waits))
        self._pending[decision.id] = _Routed(pool, w, x, c.kv_ms,
                                             decision.winner.predicted_ttft_ms, waited)
        cost: CostModel = pool.spec.cost
        if decision.chosen not in self.fits:
            self.fits[decision.chosen] = WorkerFit.start(w.ttft or cost.ttft, self.cfg)
        if pool.name not in self.pooled:
            self.pooled[pool.name] = WorkerFit.start(cost.ttft, self.cfg)
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
        total_ms = ttft_ms + routed.waited_ms
        y, warm = total_ms - routed.kv_ms, self.cfg.warmup
        pooled = self.pooled[routed.pool.name]
        pooled.update(routed.x, y, self.cfg, total_ms)
        fit = self.fits[addr]
        if pooled.n >= warm:
            fit.center_on(pooled, self.cfg)
        r = fit.update(routed.x, y, self.cfg, total_ms)
        if fit.n >= warm:
            routed.worker.ttft = fit.params()
        if pooled.n >= warm:
            self._share_pool_model(routed.pool)
        return r

    def _share_pool_model(self, pool: Any) -> None:
        """Workers not yet warm start from their (warm) pool's model."""
        params = self.pooled[pool.name].params()
        for a, w in pool.workers.items():
            own = self.fits.get(a)
            if own is None or own.n < self.cfg.warmup:
                w.ttft = params

    # -- reporting ----------------------------------------------------------------------------
    def estimates(self) -> dict[str, dict[str, float]]:
        """Per worker: the fitted parameters, robust scale and observation counts."""
        return {a: {"base_ms": f.theta[0], "prefill_ms_per_token": f.theta[1],
                    "ms_per_running": f.theta[2], "ms_per_queued": f.theta[3],
                    "ms_per_batch_wait": f.theta[4],
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
