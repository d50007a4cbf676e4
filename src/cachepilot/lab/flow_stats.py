"""The statistics of the flow-control study: Jain's index over normalised service, and paired
comparisons across seeds that respect each measure's bounds, with Holm's correction.

* Positive, unbounded measures (TTFT percentiles): the paired **log ratio** per seed, a
  Student-t interval on its mean, reported as a ratio (ours / theirs). A ratio interval can
  never cross zero into negative latencies, and latency effects are multiplicative.
* Bounded measures (Jain's index, hit rates in [0, 1]; counts ≥ 0): a **paired bootstrap**
  of the mean difference (percentile interval, 10 000 resamples, seeded): its endpoints are
  differences of attainable means, so it never claims an index above 1.
* p-values by an **exact sign-flip permutation** test of the paired differences (all 2^n
  sign assignments for n ≤ 16 seeds): no normality assumed; Holm's step-down correction
  over a family of comparisons.

(Kept here until the shared statistics of ``cachepilot.lab`` exist; then it moves there.)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import numpy as np

from cachepilot.lab import stats
from cachepilot.lab.stats import t975


def jain(xs: Sequence[float]) -> float:
    """Jain's fairness index (Σx)² / (n·Σx²), in [1/n, 1]; 1 when every x is equal."""
    a = np.asarray(xs, dtype=float)
    if a.size == 0 or not np.any(a):
        return float("nan")
    return float(a.sum() ** 2 / (a.size * (a ** 2).sum()))


def water_fill(total: float, demands: Mapping[str, float]) -> dict[str, float]:
    """Max-min fair shares of ``total`` over ``demands``: tenants asking less than the level
    get what they ask, the rest share the remainder equally (Jain's "optimal allocation")."""
    shares = dict.fromkeys(demands, 0.0)
    left = total
    open_ = sorted((d, t) for t, d in demands.items() if d > 0)
    while open_ and left > 1e-9:
        level = left / len(open_)
        d, t = open_[0]
        if d <= level:
            shares[t] = d
            left -= d
            open_.pop(0)
        else:
            for _, t2 in open_:
                shares[t2] = level
            left = 0.0
            open_ = []
    return shares


def normalised_jain(served: Mapping[str, float], demanded: Mapping[str, float]) -> float:
    """Jain's index over x_i = s_i / O_i, O_i the max-min fair share of what was served
    given what each tenant asked for (tenants that asked for nothing are left out)."""
    fair = water_fill(sum(served.values()), demanded)
    xs = [served.get(t, 0.0) / o for t, o in fair.items() if demanded.get(t, 0) > 0 and o > 0]
    return jain(xs) if len(xs) > 1 else float("nan")


def sign_flip_p(diffs: Sequence[float]) -> float:
    """Two-sided exact permutation p-value of mean(diffs) = 0 under random signs."""
    d = np.asarray([x for x in diffs if math.isfinite(x)], dtype=float)
    n = d.size
    if n == 0:
        return float("nan")
    observed = abs(d.mean())
    if n > 16:  # too many assignments: a seeded Monte Carlo sample of them
        rng = np.random.default_rng(0)
        signs = rng.choice((-1.0, 1.0), size=(100_000, n))
    else:
        signs = np.array(list(itertools.product((-1.0, 1.0), repeat=n)))
    means = np.abs((signs * d).mean(axis=1))
    return float((means >= observed - 1e-12).mean())


def log_ratio(ours: Sequence[float], theirs: Sequence[float]) -> dict[str, float]:
    """Paired ratio ours/theirs: geometric mean and 95 % t-interval of the per-seed log
    ratios, with the sign-flip p-value."""
    logs = [math.log(a / b) for a, b in zip(ours, theirs, strict=True)
            if a > 0 and b > 0 and math.isfinite(a) and math.isfinite(b)]
    if not logs:
        return {"ratio": float("nan"), "lo": float("nan"), "hi": float("nan"),
                "p": float("nan"), "n": 0}
    m = float(np.mean(logs))
    h = t975(len(logs) - 1) * float(np.std(logs, ddof=1)) / math.sqrt(len(logs)) \
        if len(logs) > 1 else 0.0
    return {"ratio": math.exp(m), "lo": math.exp(m - h), "hi": math.exp(m + h),
            "p": sign_flip_p(logs), "n": len(logs)}


def bootstrap_diff(ours: Sequence[float], theirs: Sequence[float],
                   resamples: int = 10_000) -> dict[str, float]:
    """Paired mean difference ours − theirs with a percentile bootstrap 95 % interval, and
    the sign-flip p-value."""
    d = np.array([a - b for a, b in zip(ours, theirs, strict=True)
                  if math.isfinite(a) and math.isfinite(b)], dtype=float)
    if d.size == 0:
        return {"diff": float("nan"), "lo": float("nan"), "hi": float("nan"),
                "p": float("nan"), "n": 0}
    rng = np.random.default_rng(12345)
    means = d[rng.integers(0, d.size, size=(resamples, d.size))].mean(axis=1)
    lo, hi = np.percentile(means, (2.5, 97.5))
    return {"diff": float(d.mean()), "lo": float(lo), "hi": float(hi),
            "p": sign_flip_p(d.tolist()), "n": int(d.size)}


def holm(pvalues: Mapping[str, float], alpha: float = 0.05) -> dict[str, bool]:
    """Holm's step-down (:func:`cachepilot.lab.stats.holm`): which hypotheses of the
    family, by name, are rejected at ``alpha``."""
    names = list(pvalues)
    adjusted = stats.holm([pvalues[k] for k in names])
    return {k: bool(q <= alpha) for k, q in zip(names, adjusted, strict=True)}
