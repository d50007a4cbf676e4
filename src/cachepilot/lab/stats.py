"""Across-seed statistics for the studies: means with Student-t 95 % intervals, and paired
differences (same seed = same arrivals for every policy, so policies are compared seed by
seed, which removes the workload draw's variance from the comparison).

A difference is a *finding* only when its paired 95 % interval excludes zero. The t quantiles
are tabulated here (two-sided 95 %, 1–30 degrees of freedom, then the normal 1.96) rather
than taken from scipy, which the project would otherwise not need.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t975(dof: int) -> float:
    return _T975[dof - 1] if 1 <= dof <= len(_T975) else 1.96


def ci95(xs: Sequence[float | None]) -> dict[str, float]:
    """Mean and Student-t 95 % interval over seeds (None and NaN dropped)."""
    a = np.array([x for x in xs if x is not None and math.isfinite(x)], dtype=float)
    if a.size == 0:
        return {"mean": float("nan"), "lo": float("nan"), "hi": float("nan"), "n": 0,
                "sd": float("nan")}
    m = float(a.mean())
    if a.size == 1:
        return {"mean": m, "lo": m, "hi": m, "n": 1, "sd": 0.0}
    sd = float(a.std(ddof=1))
    h = t975(a.size - 1) * sd / math.sqrt(a.size)
    return {"mean": m, "lo": m - h, "hi": m + h, "n": int(a.size), "sd": sd}


def paired(a: Sequence[float], b: Sequence[float]) -> dict[str, float | bool]:
    """The mean of ``a − b`` over seeds (both measured on the same seeds, in order) with its
    95 % interval; ``significant`` when the interval excludes zero. ``rel`` is the mean
    difference relative to the mean of ``b``."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} vs {len(b)}")
    d = ci95([x - y for x, y in zip(a, b, strict=True)])
    base = float(np.mean(b)) if len(b) else float("nan")
    sig = d["n"] > 1 and (d["lo"] > 0 or d["hi"] < 0)
    return {**d, "significant": bool(sig),
            "rel": d["mean"] / base if base else float("nan"),
            "rel_lo": d["lo"] / base if base else float("nan"),
            "rel_hi": d["hi"] / base if base else float("nan")}
