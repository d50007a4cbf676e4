"""The seed-claims study's PNG plots."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from cachepilot.lab.output import StudyOutput
from cachepilot.lab.plots import plt

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def make_all(results: list[dict], extra: dict[str, Any], tables: dict[str, Any],
             output: StudyOutput) -> dict[str, str]:
    """Every plot, saved by ``output``: plot name → file name."""
    figs = {}
    for wl in ("shared", "hotspot", "bursty"):
        figs[f"ttft_{wl}"] = output.figure(ttft_cdf(results, wl), f"ttft_{wl}.png")
    figs["imbalance"] = output.figure(imbalance(tables), "imbalance.png")
    figs["weight_sweep"] = output.figure(weight_sweep(extra["sweeps"]), "weight_sweep.png")
    figs["seed_vs_weight"] = output.figure(seed_vs_weight(extra["seed_vs_weight"]),
                                           "seed_vs_weight.png")
    return figs


def ttft_cdf(results: list[dict], workload: str) -> Figure:
    rows = [r for r in results if r["workload"] == workload]
    fig, ax = plt.subplots(figsize=(8, 5))
    if rows:
        for p, s in rows[0]["runs"].items():
            if "ttft_sample" not in s:
                continue
            xs = np.sort(np.concatenate([r["runs"][p]["ttft_sample"] for r in rows]))
            ax.plot(xs * 1000, np.linspace(0, 1, len(xs)), label=p,
                    lw=2.2 if p in ("priced", "adaptive") else 1.2)
        ideal = np.mean([r["ideal_p50_s"] for r in rows]) * 1000
        ax.axvline(ideal, color="k", ls=":", lw=1, label=f"ideal median {ideal:.0f} ms")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT distribution per policy: {workload} (all seeds pooled)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def imbalance(tables: dict[str, Any]) -> Figure:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, wl in zip(axes, ("shared", "hotspot"), strict=True):
        t = tables.get(wl, {})
        names = list(t)
        for j, key in enumerate(("imbalance_assigned", "imbalance_busy")):
            m = [t[p][key]["mean"] for p in names]
            err = [[t[p][key]["mean"] - t[p][key]["lo"] for p in names],
                   [t[p][key]["hi"] - t[p][key]["mean"] for p in names]]
            ax.bar(np.arange(len(names)) + (j - 0.5) * 0.38, m, 0.38, yerr=err, capsize=2,
                   label="assigned requests" if j == 0 else "busy time")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(np.arange(len(names)), names, rotation=60, ha="right", fontsize=8)
        ax.set_title(f"{wl}: max/mean across 3 workers (95% CI)")
    axes[0].set_ylabel("imbalance")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def weight_sweep(sweeps: dict[str, Any]) -> Figure:
    fig, axes = plt.subplots(1, len(sweeps), figsize=(11, 4.5))
    for ax, (regime, s) in zip(np.atleast_1d(axes), sweeps.items(), strict=True):
        ws = [float(w) for w in s["curve"]]
        xs = [max(w, 0.0625) for w in ws]  # 0 drawn at the left edge of the log axis
        for q, color in (("p50", "C0"), ("p90", "C1")):
            m = np.array([s["curve"][k][q]["mean"] for k in s["curve"]]) * 1000
            lo = np.array([s["curve"][k][q]["lo"] for k in s["curve"]]) * 1000
            hi = np.array([s["curve"][k][q]["hi"] for k in s["curve"]]) * 1000
            ax.plot(xs, m, "o-", color=color, label=f"fixed weight, {q}")
            ax.fill_between(xs, lo, hi, color=color, alpha=0.2)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("load weight (0 drawn at 1/16)")
        ax.set_ylabel("TTFT (ms)")
        better = ", ".join(f"{w:g}" for w in s["better_than_unit"]) or "none"
        ax.set_title(f"{regime}: significantly better than 1 (Holm): {better}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def seed_vs_weight(sv: dict[str, Any]) -> Figure:
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(sv["effects"])
    mean = np.array([sv["effects"][k]["mean"] for k in names]) * 1000
    lo = np.array([sv["effects"][k]["lo"] for k in names]) * 1000
    hi = np.array([sv["effects"][k]["hi"] for k in names]) * 1000
    ax.errorbar(names, mean, yerr=[mean - lo, hi - mean], fmt="o", color="C2", capsize=4,
                label="paired Δ median TTFT from unit weights (95% CI)")
    ax.axhline(0.0, color="k", lw=0.8)
    ax.axhspan(-sv["seed_sd_s"] * 1000, sv["seed_sd_s"] * 1000, color="C3", alpha=0.15,
               label="± seed-to-seed SD of median TTFT (unit weights)")
    ax.set_ylabel("ms")
    ax.set_title(f"Seed variance vs weight changes ({sv['workload']} workload, priced)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
