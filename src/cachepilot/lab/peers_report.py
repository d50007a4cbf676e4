"""The peers study's statistics, report.md, plots and summary (the runs: :mod:`.peers`).

Every comparison is the default policy against one other policy on one workload and one
TTFT percentile, paired by seed: the geometric mean of the per-seed ratios with its 95 %
interval (:func:`cachepilot.lab.stats.paired_ratio`). All of a study's TTFT comparisons are
one family, adjusted together with Holm's method; the report gives every count raw and
adjusted, and calls a difference a win or a loss only when its adjusted p-value is below
0.05 (raw-only significance is shown, but as such). Hit rates are compared in points with
:func:`~cachepilot.lab.stats.paired_difference`, a second family.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from cachepilot.lab.output import StudyOutput, seeds_phrase
from cachepilot.lab.peers import CORE_WORKLOADS, DEFAULT, METRICS, PEERS, SLOT_ABLATION
from cachepilot.lab.plots import paired_differences, plt
from cachepilot.lab.stats import adjust, ci95, counts, direction, paired_difference, paired_ratio


def _rows(data: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return sorted((r for r in data["results"] if r["workload"] == name), key=lambda r: r["seed"])


def analyse(data: dict[str, Any]) -> dict[str, Any]:
    """Per workload: each policy's means with intervals, the default's paired ratio to every
    other policy for p50, p90 and p99 and its hit-rate difference; Holm over the study."""
    out: dict[str, Any] = {}
    for name in data["workloads"]:
        rows = _rows(data, name)
        if not rows:
            continue

        def vals(p: str, k: str, rows: list[dict] = rows) -> list[float]:
            return [r["runs"][p][k] for r in rows]

        pols = list(rows[0]["runs"])
        table = {p: {k: ci95(vals(p, k)) for k in (*METRICS, "token_hit_rate",
                                                  "imbalance_assigned",
                                                  "predictor_rel_error_p50",
                                                  "predictor_rel_error_p90")}
                 for p in pols}
        others = [p for p in pols if p != DEFAULT]
        out[name] = {"table": table,
                     "vs": {p: {k: paired_ratio(vals(DEFAULT, k), vals(p, k)) for k in METRICS}
                            for p in others},
                     "hit": {p: paired_difference(vals(DEFAULT, "token_hit_rate"),
                                                  vals(p, "token_hit_rate")) for p in others}}
    adjust([t for _, _, _, t in comparisons(out)])
    adjust([h for st in out.values() for p, h in st["hit"].items() if p != SLOT_ABLATION])
    return out


def comparisons(stats: dict[str, Any], workloads: tuple[str, ...] | None = None
                ) -> list[tuple[str, str, str, dict[str, Any]]]:
    """(workload, other policy, metric, test) for every TTFT comparison in the family: the
    peers and round robin (the slot engines' ablation is not a peer)."""
    return [(w, p, k, t) for w, st in stats.items() if workloads is None or w in workloads
            for p, by in st["vs"].items() if p != SLOT_ABLATION for k, t in by.items()]


def summary(data: dict[str, Any], stats: dict[str, Any]) -> dict[str, Any]:
    """Wins, losses and not-significant, raw and Holm-adjusted: over the study, over the
    issue's five workloads, per workload and per peer; and every loss."""
    allc = comparisons(stats)
    core = comparisons(stats, CORE_WORKLOADS)
    peers = sorted({p for _, p, _, _ in allc})
    return {
        "seeds": data["seeds"], "default": DEFAULT, "family": len(allc),
        "all": counts(t for *_, t in allc),
        "core_workloads": {"workloads": [w for w in CORE_WORKLOADS if w in stats],
                           **counts(t for *_, t in core)},
        "by_workload": {w: counts(t for ww, _, _, t in allc if ww == w) for w in stats},
        "by_peer": {p: counts(t for _, pp, _, t in allc if pp == p) for p in peers},
        "losses": [_row(w, p, k, t) for w, p, k, t in allc
                   if direction(t, adjusted=True) == "loss"],
        "raw_losses": [_row(w, p, k, t) for w, p, k, t in allc
                       if direction(t) == "loss" and direction(t, adjusted=True) != "loss"],
    }


def _row(workload: str, peer: str, metric: str, t: dict[str, Any]) -> dict[str, Any]:
    return {"workload": workload, "peer": peer, "metric": metric, "rel": t["rel"],
            "rel_lo": t["rel_lo"], "rel_hi": t["rel_hi"], "p": t["p"], "p_holm": t["p_holm"]}


def _listed(rows: list[dict[str, Any]]) -> str:
    return "; ".join(f"{x['workload']} {x['metric'][5:8]} against {x['peer']} {x['rel']:+.1%} "
                     f"[{x['rel_lo']:+.1%}, {x['rel_hi']:+.1%}] (p {x['p']:.3f}, Holm "
                     f"{x['p_holm']:.2f})" for x in rows) + "."


def verdict(d: dict[str, Any]) -> str:
    """"**wins**"/"**loses**" when Holm-significant, "wins (raw)" when only the unadjusted
    test is, "n.s." otherwise."""
    held = direction(d, adjusted=True)
    if held != "n.s.":
        return "**wins**" if held == "win" else "**loses**"
    raw = direction(d)
    return "n.s." if raw == "n.s." else ("wins" if raw == "win" else "loses") + " (raw)"


def _count_line(c: dict[str, dict[str, int]]) -> str:
    r, h = c["raw"], c["holm"]
    return (f"{h['win']} wins, {h['loss']} losses, {h['n.s.']} n.s. after Holm "
            f"(raw: {r['win']} wins, {r['loss']} losses, {r['n.s.']} n.s.)")


def _what(w: dict[str, Any]) -> str:
    spec = w["spec"]
    what = (f"trace {Path(spec['path']).name}, ×{spec['rate_scale']:g} speed, "
            f"{spec['sample']:.0%} of its prefix groups per seed" if spec["kind"] == "trace"
            else f"{spec['kind']}, {spec['rate']:g} req/s for {spec['duration']:g} s")
    kv = (f"{w['kv_tokens']:,} tokens of KV each" if not w.get("slots") else
          f"{w['slots']} slot(s) of {w['kv_tokens'] // w['slots']:,} tokens each, "
          f"llama.cpp-like (prefill {w['prefill_ms_per_token']:g} ms/token)")
    return f"{what}; {w['workers']} workers with {kv}."


def report(data: dict[str, Any], stats: dict[str, Any], figs: list[str]) -> str:
    sm = summary(data, stats)
    n_req = sum(run["requests"] for r in data["results"] for run in r["runs"].values())
    n_peers = len(PEERS)  # vllm-router's two variants are one peer, each where it applies
    core = sm["core_workloads"]
    L = ["# CachePilot's default policy against the peer routers' models", "",
         f"{seeds_phrase(data['seeds'])}: {len(data['results'])} (workload, seed) tasks, "
         f"{n_req:,} simulated requests in {data['wall_s']:.0f} s.", "",
         f"Default policy: `{DEFAULT}` (the lowest predicted TTFT, each worker's model learned "
         "online, plus the congestion its prefill causes). Against it: "
         f"{n_peers} peer models and round robin (docs/simulator.md, "
         "docs/research/peer-models.md); vllm-router's model is the token-matching one in "
         "front of paged workers and the untokenised one (no affinity) in front of "
         "llama.cpp-like workers, as the real router behaves. Each seed draws the workload "
         "once and every policy serves the same requests. A cell is the default's TTFT over "
         "the other's: the geometric mean of the per-seed ratios as a change, with its 95 % "
         "interval (a t interval on the log ratios). "
         f"All {sm['family']} TTFT comparisons (workloads × {n_peers + 1} others × p50/p90/"
         "p99) are one family, adjusted with Holm's method: **wins** / **loses** when the "
         "adjusted p < 0.05; \"wins (raw)\" when only the unadjusted test is below 0.05. "
         f"On the slot-engine workloads (`llama_*`) one more row, `{SLOT_ABLATION}`, is the "
         "default without its eviction term: an ablation, outside the family.", "",
         f"**All workloads:** {_count_line(sm['all'])}.", "",
         f"**{', '.join(core['workloads'])}:** {_count_line(core)}.", ""]
    L += [("**Holm-significant losses:** " + _listed(sm["losses"]) if sm["losses"]
           else "**No Holm-significant loss.**")
          + (" Significant before adjustment only: " + _listed(sm["raw_losses"])
             if sm["raw_losses"] else ""), ""]
    L += predictor_section(stats)
    for name, st in stats.items():
        L += [f"## {name}", "", _what(data["workloads"][name]), "",
              "| policy | p50 ms | p90 ms | p99 ms | token hit rate | imbalance | "
              "predictor median \\|error\\| |", "|---|---|---|---|---|---|---|"]
        for p, t in st["table"].items():
            L.append(f"| {p} | " + " | ".join(f"{t[k]['mean'] * 1000:.1f}" for k in METRICS)
                     + f" | {t['token_hit_rate']['mean']:.3f} | "
                     f"{t['imbalance_assigned']['mean']:.2f} | "
                     f"{t['predictor_rel_error_p50']['mean']:.1%} |")
        L += ["", f"| {DEFAULT} vs | p50 | p90 | p99 | hit rate (points) |",
              "|---|---|---|---|---|"]
        for p, d in st["vs"].items():
            h = st["hit"][p]
            L.append(f"| {p} | " + " | ".join(
                f"{d[k]['rel']:+.1%} [{d[k]['rel_lo']:+.1%}, {d[k]['rel_hi']:+.1%}] "
                f"{verdict(d[k])}" for k in METRICS)
                + f" | {h['mean'] * 100:+.1f} [{h['lo'] * 100:+.1f}, {h['hi'] * 100:+.1f}]"
                  f" {_hit_verdict(h)} |")
        L.append("")
    L += ["## Plots", ""] + [f"![{f}]({f})" for f in figs] + [""]
    return "\n".join(L)


def _hit_verdict(h: dict[str, Any]) -> str:
    """A hit-rate difference's verdict (higher is better), as :func:`verdict`'s."""
    if not h["significant"]:
        return "n.s."
    word = "higher" if h["mean"] > 0 else "lower"
    return f"**{word}**" if h.get("significant_holm") else f"{word} (raw)"


def predictor_section(stats: dict[str, Any]) -> list[str]:
    """The default policy's TTFT predictor on these seeds: how far its a-priori prediction
    for the chosen worker was from the measured TTFT (relative), per workload."""
    L = ["## The predictor's error on these seeds", "",
         f"`{DEFAULT}`'s prediction for the worker it chose against the TTFT measured there, "
         "relative to the measured TTFT: the run's median and p90 of |error|, mean over seeds "
         "with its 95 % interval (the study's cost model: the default prior, no admission "
         "limit).", "", "| workload | median \\|error\\| | p90 \\|error\\| |", "|---|---|---|"]
    for name, st in stats.items():
        t = st["table"][DEFAULT]
        p50, p90 = t["predictor_rel_error_p50"], t["predictor_rel_error_p90"]
        # An error is ≥ 0: an interval's lower end below it says only "near 0".
        L.append(f"| {name} | {p50['mean']:.1%} [{max(0, p50['lo']):.1%}, {p50['hi']:.1%}] | "
                 f"{p90['mean']:.1%} [{max(0, p90['lo']):.1%}, {p90['hi']:.1%}] |")
    return [*L, ""]


def _label(metric: str) -> str:
    return metric.replace("ttft_", "").replace("_s", "")


def _paired_panel(ax: Any, st: dict[str, Any]) -> None:
    paired_differences(ax, st["vs"], METRICS, f"{DEFAULT} / other − 1, % (95% CI)")
    ax.grid(alpha=0.3)


def _ttft_panel(ax: Any, st: dict[str, Any]) -> None:
    t = st["table"]
    pols = list(t)
    for j, k in enumerate(METRICS):
        ax.bar(np.arange(len(pols)) + (j - 1) * 0.27,
               np.array([t[p][k]["mean"] for p in pols]) * 1000, width=0.27, label=_label(k))
    ax.set_yscale("log")
    ax.set_xticks(np.arange(len(pols)), pols, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("TTFT (ms)")


def plot(stats: dict[str, Any], output: StudyOutput) -> list[str]:
    """One PNG per view, a panel per workload."""
    figs = []
    for name, panel in (("paired_differences.png", _paired_panel),
                        ("ttft_by_policy.png", _ttft_panel)):
        fig, axes = plt.subplots(1, len(stats), figsize=(4.2 * len(stats), 4.2),
                                 squeeze=False)
        for ax, (wl, st) in zip(axes[0], stats.items(), strict=True):
            panel(ax, st)
            ax.set_title(wl)
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        figs.append(output.figure(fig, name))
    return figs


def write_outputs(data: dict[str, Any], output: StudyOutput) -> dict[str, Any]:
    """The statistics, the plots, report.md and results.json; the summary."""
    stats = analyse(data)
    figs = plot(stats, output)
    sm = summary(data, stats)
    output.write(report(data, stats, figs),
                 {"seeds": data["seeds"], "wall_s": data["wall_s"], "default": DEFAULT,
                  "summary": sm, "workloads": data["workloads"], "stats": stats,
                  "results": data["results"]})
    return {"stats": stats, "summary": sm}
