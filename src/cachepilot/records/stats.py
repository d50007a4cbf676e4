"""``cachepilot decisions stats LOG``: how good were the predictions, and where did requests go.

Also the one summary of measured requests every driver reports (:func:`ttft_summary`,
:func:`imbalance`): the simulator, the load generator and the real-model experiment all
name TTFT percentiles ``ttft_p50_s``, ``ttft_p90_s``, ``ttft_p99_s``, ``ttft_mean_s`` (seconds)
and the busiest worker's share over the mean ``imbalance``. Decision records themselves keep
milliseconds (``predicted_ttft_ms``), and so does the prediction-error summary below.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from cachepilot.core.lifecycle import FIRST_TOKEN


def ttft_summary(ttfts_s: Iterable[float]) -> dict[str, float]:
    """TTFT percentiles and mean in seconds (NaN when there is none)."""
    x = np.asarray(list(ttfts_s), dtype=float)

    def pct(q: float) -> float:
        return float(np.percentile(x, q)) if x.size else float("nan")

    return {"ttft_p50_s": pct(50), "ttft_p90_s": pct(90), "ttft_p99_s": pct(99),
            "ttft_mean_s": float(x.mean()) if x.size else float("nan")}


def imbalance(counts: Iterable[float]) -> float:
    """The largest value over the mean (1.0: perfectly even; NaN when empty or all zero)."""
    x = np.asarray(list(counts), dtype=float)
    return float(x.max() / x.mean()) if x.size and x.mean() > 0 else float("nan")


def summarize(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    n = 0
    predicted_hits = 0
    hit_pairs: list[tuple[bool, bool]] = []  # (predicted, measured)
    pred_ttft: list[float] = []
    meas_ttft: list[float] = []
    workers: dict[str, dict[str, Any]] = {}
    status: dict[str, int] = {}
    policies: dict[str, int] = {}
    t0 = t1 = None
    for rec in records:
        n += 1
        t0 = rec["time"] if t0 is None else min(t0, rec["time"])
        t1 = rec["time"] if t1 is None else max(t1, rec["time"])
        policies[rec["policy"]] = policies.get(rec["policy"], 0) + 1
        w = workers.setdefault(rec["chosen"], {"decisions": 0, "predicted_hits": 0,
                                                "ttft": [], "pred": []})
        w["decisions"] += 1
        if rec.get("predicted_hit"):
            predicted_hits += 1
            w["predicted_hits"] += 1
        out = rec.get("outcome") or {}
        if "status" in out:
            status[str(out["status"])] = status.get(str(out["status"]), 0) + 1
        if out.get("cached_tokens") is not None:
            hit_pairs.append((bool(rec.get("predicted_hit")), out["cached_tokens"] > 0))
        ttft = out.get("ttft_ms")
        if (ttft is not None and out.get("ttft_kind") == FIRST_TOKEN
                and rec.get("predicted_ttft_ms") is not None):
            pred_ttft.append(rec["predicted_ttft_ms"])
            meas_ttft.append(ttft)
            w["ttft"].append(ttft)
            w["pred"].append(rec["predicted_ttft_ms"])
    summary: dict[str, Any] = {
        "decisions": n,
        "span_s": (t1 - t0) if n else 0.0,
        "policies": policies,
        "status": status,
        "hit_rate": {
            "predicted": predicted_hits / n if n else None,
            "measured": (sum(m for _, m in hit_pairs) / len(hit_pairs)) if hit_pairs else None,
            "predicted_on_measured": (sum(p for p, _ in hit_pairs) / len(hit_pairs)
                                      if hit_pairs else None),
            "agreement": (sum(p == m for p, m in hit_pairs) / len(hit_pairs)
                          if hit_pairs else None),
            "with_report": len(hit_pairs),
            "confusion": {f"{'hit' if p else 'miss'}→{'hit' if m else 'miss'}":
                          sum(1 for q in hit_pairs if q == (p, m))
                          for p in (True, False) for m in (True, False)},
        },
        "ttft": _ttft_summary(pred_ttft, meas_ttft),
        "workers": {},
    }
    for addr in sorted(workers):
        w = workers[addr]
        summary["workers"][addr] = {
            "decisions": w["decisions"],
            "share": w["decisions"] / n,
            "predicted_hit_rate": w["predicted_hits"] / w["decisions"],
            "ttft": _ttft_summary(w["pred"], w["ttft"]),
        }
    return summary


def _ttft_summary(pred: list[float], meas: list[float]) -> dict[str, Any]:
    if not meas:
        return {"n": 0}
    p = np.asarray(pred, dtype=float)
    m = np.asarray(meas, dtype=float)
    err = m - p
    a = np.abs(err)
    return {
        "n": len(m),
        "measured_mean_ms": float(m.mean()),
        "measured_p50_ms": float(np.percentile(m, 50)),
        "measured_p90_ms": float(np.percentile(m, 90)),
        "predicted_mean_ms": float(p.mean()),
        "bias_ms": float(err.mean()),  # measured − predicted
        "abs_error_p50_ms": float(np.percentile(a, 50)),
        "abs_error_p90_ms": float(np.percentile(a, 90)),
        "rel_error_p50": float(np.percentile(a / np.maximum(m, 1e-9), 50)),
    }


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _ms(d: Mapping[str, Any], key: str) -> str:
    return f"{d[key]:.1f}" if key in d else "–"


def render(summary: Mapping[str, Any], console: Console) -> None:
    hr = summary["hit_rate"]
    t = summary["ttft"]
    console.print(f"{summary['decisions']} decisions over {summary['span_s']:.1f} s · "
                  f"policies {summary['policies']} · status {summary['status'] or '–'}")
    console.print(f"prefix hit rate: predicted {_pct(hr['predicted'])} of all decisions; "
                  f"of the {hr['with_report']} with a worker report, predicted "
                  f"{_pct(hr['predicted_on_measured'])}, measured {_pct(hr['measured'])}, "
                  f"prediction right {_pct(hr['agreement'])} {hr['confusion']}")
    if t["n"]:
        console.print(f"TTFT ({t['n']} streamed): measured mean {t['measured_mean_ms']:.1f} ms "
                      f"(p50 {t['measured_p50_ms']:.1f}, p90 {t['measured_p90_ms']:.1f}), "
                      f"predicted mean {t['predicted_mean_ms']:.1f} ms; error: bias "
                      f"{t['bias_ms']:+.1f} ms, |error| p50 {t['abs_error_p50_ms']:.1f} ms, "
                      f"p90 {t['abs_error_p90_ms']:.1f} ms, relative p50 "
                      f"{100 * t['rel_error_p50']:.0f}%")
    else:
        console.print("TTFT: no streamed outcome recorded")
    tab = Table(title="per worker", title_justify="left")
    for col in ("worker", "decisions", "share", "pred. hit", "TTFT mean", "bias", "|err| p50"):
        tab.add_column(col, justify="left" if col == "worker" else "right")
    for addr, w in summary["workers"].items():
        wt = w["ttft"]
        tab.add_row(addr, str(w["decisions"]), _pct(w["share"]), _pct(w["predicted_hit_rate"]),
                    _ms(wt, "measured_mean_ms"), _ms(wt, "bias_ms"), _ms(wt, "abs_error_p50_ms"))
    console.print(tab)


def plot(records: Iterable[Mapping[str, Any]], path: str) -> None:
    """Predicted vs measured TTFT, the error over time, and each worker's share."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = list(records)
    summary = summarize(recs)
    pts = [(r["time"], r["predicted_ttft_ms"], r["outcome"]["ttft_ms"]) for r in recs
           if r.get("outcome") and r["outcome"].get("ttft_ms") is not None
           and r["outcome"].get("ttft_kind") == FIRST_TOKEN]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ax = axes[0]
    if pts:
        t, p, m = map(np.asarray, zip(*pts, strict=True))
        ax.scatter(p, m, s=6, alpha=0.5)
        hi = float(max(p.max(), m.max()))
        ax.plot([0, hi], [0, hi], "k--", lw=1, label="perfect")
        ax.legend()
        axes[1].plot(t - t.min(), m - p, ".", ms=3, alpha=0.5)
        axes[1].axhline(0, color="k", lw=1)
    ax.set(xlabel="predicted TTFT (ms)", ylabel="measured TTFT (ms)",
           title="TTFT: predicted vs measured")
    axes[1].set(xlabel="time since first decision (s)", ylabel="measured − predicted (ms)",
                title="TTFT prediction error")
    workers = list(summary["workers"])
    axes[2].bar(range(len(workers)), [100 * summary["workers"][w]["share"] for w in workers])
    axes[2].set_xticks(range(len(workers)), workers, rotation=30, ha="right", fontsize=8)
    hr = summary["hit_rate"]
    axes[2].set(ylabel="share of decisions (%)",
                title=f"per-worker share · hit predicted {_pct(hr['predicted'])}, "
                      f"measured {_pct(hr['measured'])}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
