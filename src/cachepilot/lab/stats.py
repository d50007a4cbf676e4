"""Across-seed statistics for the studies: means with Student-t 95 % intervals, paired
comparisons that respect the measure's bounds, and Holm's multiple-comparison adjustment.

Every study draws each (workload, seed) once and runs every policy on the very same requests,
so policies are compared seed by seed, which removes the workload draw's variance.

* **Positive quantities** (TTFT percentiles, throughput): :func:`paired_ratio`, a Student-t
  interval on the per-seed log ratio ``log(a/b)``, reported as a relative change
  ``exp(·) − 1``. Effects on latency are multiplicative (a policy that halves a queue halves
  it whatever its size), and an interval on the log scale maps back to one that cannot cross
  −100 %: the old interval on the mean difference over the mean gave "−131 %" for a p90.
  A paired bootstrap was the other option; with 10 seeds its percentile intervals are too
  narrow (they ignore the t factor) and its p-values are too coarse for Holm's smallest
  threshold (0.05 / ~150 comparisons), so the t on log ratios it is.
* **Rates in [0, 1]** (token hit rate): :func:`paired_difference`, a Student-t interval on
  the per-seed differences in points, clipped to the differences that are possible given the
  baseline's mean (``[lo − b̄, hi − b̄]``).
* **Families**: :func:`holm` adjusts a study's p-values together (Holm 1979, step-down:
  controls the family-wise error rate at 5 % under any dependence, which the comparisons of
  one study have: they share seeds and the default policy's runs). Reports give each count
  raw and adjusted (:func:`counts`).

The t quantiles are tabulated (two-sided 95 %, 1–30 degrees of freedom, then the normal
1.96) and the t distribution's tail is the regularised incomplete beta function, rather than
scipy, which the project would otherwise not need.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

ALPHA = 0.05
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t975(dof: int) -> float:
    return _T975[dof - 1] if 1 <= dof <= len(_T975) else 1.96


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-14:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbeta = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
    front = math.exp(lbeta + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_pvalue(t: float, dof: int) -> float:
    """Two-sided p-value of Student's t with ``dof`` degrees of freedom."""
    if math.isnan(t) or dof < 1:
        return float("nan")
    if math.isinf(t):
        return 0.0
    return betainc(dof / 2.0, 0.5, dof / (dof + t * t))


def _clean(xs: Iterable[float | None]) -> np.ndarray:
    return np.array([x for x in xs if x is not None and math.isfinite(x)], dtype=float)


def ci95(xs: Sequence[float | None]) -> dict[str, float]:
    """Mean and Student-t 95 % interval over seeds (None and NaN dropped)."""
    a = _clean(xs)
    if a.size == 0:
        return {"mean": float("nan"), "lo": float("nan"), "hi": float("nan"), "n": 0,
                "sd": float("nan")}
    m = float(a.mean())
    if a.size == 1:
        return {"mean": m, "lo": m, "hi": m, "n": 1, "sd": 0.0}
    sd = float(a.std(ddof=1))
    h = t975(a.size - 1) * sd / math.sqrt(a.size)
    return {"mean": m, "lo": m - h, "hi": m + h, "n": int(a.size), "sd": sd}


def _t_test(d: np.ndarray) -> tuple[float, float, float, float]:
    """Mean of ``d``, its 95 % interval and the two-sided p-value of mean = 0."""
    n = d.size
    m = float(d.mean())
    if n < 2:
        return m, float("nan"), float("nan"), float("nan")
    se = float(d.std(ddof=1)) / math.sqrt(n)
    if se == 0.0:  # every seed agrees: no spread to test against
        return m, m, m, 1.0 if m == 0.0 else 0.0
    h = t975(n - 1) * se
    return m, m - h, m + h, t_pvalue(m / se, n - 1)


def _pairs(a: Sequence[float | None], b: Sequence[float | None]
           ) -> tuple[np.ndarray, np.ndarray]:
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} vs {len(b)}")
    keep = [(x, y) for x, y in zip(a, b, strict=True)
            if x is not None and y is not None and math.isfinite(x) and math.isfinite(y)]
    return (np.array([x for x, _ in keep], dtype=float),
            np.array([y for _, y in keep], dtype=float))


def paired_ratio(a: Sequence[float | None], b: Sequence[float | None]) -> dict[str, Any]:
    """``a`` against ``b`` for a positive quantity, seed by seed: the geometric mean of
    ``a/b`` as a relative change (``rel``, −0.2 = 20 % lower) with its 95 % interval
    (``rel_lo``, ``rel_hi``, never below −100 %), the t test's ``p`` on the log ratios and
    ``significant`` (p < 0.05, the same as the interval excluding 0). ``mean``/``lo``/
    ``hi`` are the log ratio's."""
    x, y = _pairs(a, b)
    if x.size == 0 or (x <= 0).any() or (y <= 0).any():
        nan = float("nan")
        return {"kind": "ratio", "n": int(x.size), "mean": nan, "lo": nan, "hi": nan,
                "p": nan, "significant": False, "rel": nan, "rel_lo": nan, "rel_hi": nan}
    m, lo, hi, p = _t_test(np.log(x / y))
    return {"kind": "ratio", "n": int(x.size), "mean": m, "lo": lo, "hi": hi, "p": p,
            "significant": bool(p < ALPHA), "rel": math.expm1(m), "rel_lo": math.expm1(lo),
            "rel_hi": math.expm1(hi)}


def paired_difference(a: Sequence[float | None], b: Sequence[float | None],
                      bounds: tuple[float, float] = (0.0, 1.0)) -> dict[str, Any]:
    """``a − b`` for a bounded measure (a rate in [0, 1] by default), seed by seed: the mean
    difference with its Student-t 95 % interval clipped to what is possible given ``b``'s
    mean, the t test's ``p`` and ``significant`` (p < 0.05)."""
    x, y = _pairs(a, b)
    if x.size == 0:
        nan = float("nan")
        return {"kind": "difference", "n": 0, "mean": nan, "lo": nan, "hi": nan, "p": nan,
                "significant": False}
    m, lo, hi, p = _t_test(x - y)
    base = float(y.mean())
    lo_ok, hi_ok = bounds[0] - base, bounds[1] - base
    return {"kind": "difference", "n": int(x.size), "mean": m,
            "lo": max(lo, lo_ok) if math.isfinite(lo) else lo,
            "hi": min(hi, hi_ok) if math.isfinite(hi) else hi,
            "p": p, "significant": bool(p < ALPHA)}


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input's order (NaN stays NaN and does not
    count in the family)."""
    idx = [i for i, p in enumerate(pvalues) if not math.isnan(p)]
    idx.sort(key=lambda i: pvalues[i])
    m = len(idx)
    out = [float("nan")] * len(pvalues)
    running = 0.0
    for rank, i in enumerate(idx):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out


def adjust(tests: Sequence[dict[str, Any]]) -> None:
    """Holm over one family: each test gains ``p_holm`` and ``significant_holm``."""
    for t, p in zip(tests, holm([t["p"] for t in tests]), strict=True):
        t["p_holm"] = p
        t["significant_holm"] = bool(p < ALPHA)


def direction(t: dict[str, Any], adjusted: bool = False, lower_is_better: bool = True) -> str:
    """``"win"``, ``"loss"`` or ``"n.s."`` for a test of ours against theirs."""
    if not t.get("significant_holm" if adjusted else "significant"):
        return "n.s."
    lower = t["mean"] < 0
    return "win" if lower == lower_is_better else "loss"


def counts(tests: Iterable[dict[str, Any]], lower_is_better: bool = True
           ) -> dict[str, dict[str, int]]:
    """Wins, losses and not-significant, raw and Holm-adjusted (after :func:`adjust`)."""
    out = {"raw": {"win": 0, "loss": 0, "n.s.": 0}, "holm": {"win": 0, "loss": 0, "n.s.": 0}}
    for t in tests:
        out["raw"][direction(t, False, lower_is_better)] += 1
        out["holm"][direction(t, True, lower_is_better)] += 1
    return out

