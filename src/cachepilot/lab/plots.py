"""What every study's plots share: matplotlib on the Agg backend (no display needed; the
import sets it once, before pyplot loads) and the paired-difference panel the studies that
compare against peers draw."""

from __future__ import annotations

from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

__all__ = ["paired_differences", "plt"]


def paired_differences(ax: Any, vs: dict[str, dict[str, Any]], metrics: tuple[str, ...],
                       xlabel: str) -> None:
    """One row per compared policy or router: each metric's paired relative difference
    (``rel``, ``rel_lo``, ``rel_hi`` of :func:`cachepilot.lab.stats.paired_ratio`) with its
    95 % interval,
    in %, the zero line marking no difference."""
    names = list(vs)
    for j, k in enumerate(metrics):
        m = np.array([vs[o][k]["rel"] for o in names]) * 100
        lo = np.array([vs[o][k]["rel_lo"] for o in names]) * 100
        hi = np.array([vs[o][k]["rel_hi"] for o in names]) * 100
        ax.errorbar(m, np.arange(len(names)) + (j - 1) * 0.25, xerr=[m - lo, hi - m], fmt="o",
                    ms=4, capsize=3, label=k.replace("ttft_", "").replace("_s", ""))
    ax.axvline(0, color="k", lw=0.8)
    ax.set_yticks(np.arange(len(names)), names, fontsize=8)
    ax.set_xlabel(xlabel)
