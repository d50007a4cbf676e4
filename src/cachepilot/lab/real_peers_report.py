"""The real-worker study's figures: per workload, each router's means over seeds with 95 %
intervals, CachePilot's paired differences from every other router (same (workload, seed)
cell = same requests), whether the issue's bar holds, a markdown report, a plot and JSON.

TTFTs are compared as ratios (:func:`~cachepilot.lab.stats.paired_ratio`: the geometric mean
of the per-cell ratios, its interval from the log ratios, never below −100 %), hit rates as
differences whose interval is clipped to what is possible
(:func:`~cachepilot.lab.stats.paired_difference`). Every comparison of a report is one family
for Holm's adjustment: a difference is **bold** only when it survives it, plain when only its
unadjusted interval excludes zero, "n.s." otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from cachepilot.lab.output import StudyOutput
from cachepilot.lab.stats import (
    adjust,
    ci95,
    counts,
    direction,
    paired_difference,
    paired_ratio,
)
from cachepilot.tooling.llamacpp.routers import ROUTERS

if TYPE_CHECKING:
    from matplotlib.figure import Figure

OURS = "cachepilot"
TTFT = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s")
COMPARED = (*TTFT, "token_hit_rate")  # paired against every other router
CPU = "router_cpu_ms_per_request"  # absent from results before 2026-12-07
TABLE = (*TTFT, "ttft_mean_s", "token_hit_rate", "imbalance", "errors", CPU)
ALL = "all workloads"  # the pooled cells


def _cells(phases: list[dict[str, Any]], workload: str | None) -> dict[tuple[str, int], dict]:
    """(workload, seed) → router → phase, for cells where every router ran."""
    out: dict[tuple[str, int], dict[str, dict]] = {}
    for p in phases:
        if workload is None or p["workload"] == workload:
            out.setdefault((p["workload"], p["seed"]), {})[p["router"]] = p
    return out


def analyse(data: dict[str, Any]) -> dict[str, Any]:
    """Per workload and pooled over all cells: ``table`` (router → metric → ci95) and
    ``vs`` (other router → metric → :func:`compare` of ours with theirs), Holm-adjusted
    over the whole report."""
    routers = list(data["config"]["routers"])
    out: dict[str, Any] = {}
    pooled = [ALL] if len(data["workloads"]) > 1 else []
    for name in [*data["workloads"], *pooled]:
        cells = _cells(data["phases"], None if name == ALL else name)
        rows = [cells[k] for k in sorted(cells) if all(r in cells[k] for r in routers)]
        if not rows:
            continue

        def vals(router: str, k: str, rows: list[dict] = rows) -> list[float]:
            return [float("nan") if r[router].get(k) is None else r[router][k] for r in rows]

        out[name] = {
            "cells": len(rows),
            "table": {r: {k: ci95(vals(r, k)) for k in TABLE} for r in routers},
            "vs": {r: {k: compare(k, vals(OURS, k), vals(r, k)) for k in COMPARED}
                   for r in routers if r != OURS} if OURS in routers else {}}
        out[name]["bar"] = bar(out[name], routers)
    adjust(tests(out))
    return out


def compare(k: str, ours: list[float], theirs: list[float]) -> dict[str, Any]:
    """CachePilot against one router on one measure, cell by cell: a ratio for a TTFT,
    a bounded difference for the hit rate."""
    if k == "token_hit_rate":
        return paired_difference(ours, theirs)
    return paired_ratio(ours, theirs)


def tests(stats: dict[str, Any], measures: tuple[str, ...] = COMPARED
          ) -> list[dict[str, Any]]:
    """Every paired comparison of the report (one Holm family), in a fixed order."""
    return [d[k] for st in stats.values() for d in st["vs"].values() for k in measures]


def holm_summary(stats: dict[str, Any]) -> str:
    """The family's significant differences, unadjusted and after Holm."""
    ttft = counts(tests(stats, TTFT))
    hit = counts(tests(stats, ("token_hit_rate",)), lower_is_better=False)
    n = len(tests(stats))

    def say(kind: str) -> str:
        win = ttft[kind]["win"] + hit[kind]["win"]
        loss = ttft[kind]["loss"] + hit[kind]["loss"]
        return f"{win} better, {loss} worse"

    return (f"Of the {n} comparisons (every workload and the pooled cells, every router, "
            f"p50/p90/p99 and hit rate), significant before adjustment: {say('raw')}; "
            f"after Holm's adjustment over all {n}: {say('holm')}.")


# Issue 24's bar against the best peer router, on the means over seeds: CachePilot's median
# at most 0.9x the best peer's, its p90 at most 1.0x, its hit rate at least the best
# peer's minus 1 point. (measure, lower is better, the bar: ours <= factor x theirs + offset)
BAR = (("ttft_p50_s", True, 0.9, 0.0), ("ttft_p90_s", True, 1.0, 0.0),
       ("token_hit_rate", False, 1.0, -0.01))


def bar(st: dict[str, Any], routers: list[str]) -> dict[str, Any]:
    """The issue's bar (:data:`BAR`) against the best peer router (sglang-/vllm-router)
    per measure. ``means``: it holds on the means over seeds; ``not_worse``: no significant
    paired loss."""
    peers = [r for r in routers if r in ROUTERS and ROUTERS[r].is_peer]
    if OURS not in routers or not peers:
        return {}
    out = {}
    for k, lower_better, factor, offset in BAR:
        sign = 1 if lower_better else -1
        best = min(peers, key=lambda p: sign * st["table"][p][k]["mean"])
        d = st["vs"][best][k]
        worse = d["significant"] and sign * d["mean"] > 0
        ours, theirs = st["table"][OURS][k]["mean"], st["table"][best][k]["mean"]
        holds = ours <= factor * theirs if lower_better else ours >= theirs + offset
        out[k] = {"best_peer": best, "ours": ours, "theirs": theirs,
                  "bar": factor if lower_better else offset,
                  "means": bool(holds), "not_worse": not worse}
    return out


def verdict(d: dict[str, Any], lower_better: bool = True) -> str:
    """n.s.; better/worse when the unadjusted interval excludes zero; bold when the
    difference survives Holm's adjustment too."""
    raw = direction(d, False, lower_better)
    if raw == "n.s.":
        return raw
    word = "better" if raw == "win" else "worse"
    return f"**{word}**" if direction(d, True, lower_better) != "n.s." else word


def _ms(x: float) -> str:
    return "–" if x != x else f"{x * 1000:.0f}"


def report(data: dict[str, Any], stats: dict[str, Any], plot_name: str) -> str:
    cfg = data["config"]
    phases = data["phases"]
    cpu = any(p.get(CPU) is not None for p in phases)  # measured since 2026-12-07
    loads = [x for p in phases for x in p["loadavg_1m"]]
    vllm = cfg.get("engine") == "vllm"
    api = {"chat": "chat completions", "completions": "text completions"}[
        cfg.get("api", "chat")]
    workers = (f"{cfg['workers']} vLLM workers (Gemma 3 270M, bf16, CPU), up for the whole "
               "study, their prefix caches reset before every phase" if vllm else
               f"{cfg['workers']} llama-server workers (Gemma 3 270M Q4_K_M), restarted for "
               "every phase (fresh caches, the same warm-up)")
    learned = ("CachePilot's gateway starts every phase afresh but keeps its TTFT "
               "predictor's fits from phase to phase (`--predictor-state`), as one gateway "
               "running through the study would" if cfg.get("keep_predictor") else
               "CachePilot's gateway starts every phase from the calibrated prior (its "
               "predictor's warm-up is longer than a phase)")
    pooled = data.get("pooled_from") or []
    runs = ("Pooled from " + "; ".join(f"`{r['command']}` ({r['out']})" for r in pooled)
            + ": each cell is paired within its own run. ") if pooled else ""
    L = ["# CachePilot against sglang-router and vllm-router on real "
         f"{'vLLM' if vllm else 'llama.cpp'} workers ({api})", "",
         f"{runs}{len(phases)} phases ({len(cfg['workloads'])} workloads × "
         f"{len(cfg['seeds'])} seeds ({', '.join(map(str, cfg['seeds']))}) × "
         f"{len(cfg['routers'])} routers), "
         f"{cfg['requests']} requests each, {data['wall_s'] / 60:.1f} min wall. {workers}; "
         f"{learned}. "
         "Every router of a (workload, seed) cell serves the same requests at the same "
         "arrival times; the order of the routers rotates from cell to cell. 1-minute load "
         f"average during the study: {min(loads):.1f}–{max(loads):.1f} (the machine is "
         "shared: timings are noisy).", "",
         "TTFT is measured at the client (first streamed token), in ms; the hit rate is the "
         "workers' own cached prompt tokens over prompt tokens; imbalance is the busiest "
         "worker's prompt tokens over the mean. Means over seeds with 95 % intervals. "
         "CachePilot against each other router, paired by cell: for TTFT the geometric mean "
         "of the per-cell ratios as a change, its 95 % interval from the log ratios; for the "
         "hit rate the mean difference, its 95 % interval clipped to what is possible. "
         "better / worse when the unadjusted interval excludes zero, **bold** when the "
         "difference also survives Holm's adjustment over every comparison of this report; "
         "n.s. otherwise. The bar's \"significant loss\" is the unadjusted test (the "
         "stricter on CachePilot)."
         + (" Router CPU: what the router's processes (Envoy and the gateway, or the peer "
            "router) used while the phase's requests ran, per request; the workers compute "
            "on the same cores." if cpu else ""), "", holm_summary(stats), ""]
    for name, st in stats.items():
        spec = data["workloads"].get(name)
        what = (f"{spec['kind']}, {spec['rate']:g} req/s" if spec else
                f"every (workload, seed) cell, {st['cells']} pairs")
        L += [f"## {name}", "", what + ".", "",
              "| router | p50 ms | p90 ms | p99 ms | mean ms | hit rate | imbalance | errors |"
              + (" router CPU ms/request |" if cpu else ""),
              "|---|---|---|---|---|---|---|---|" + ("---|" if cpu else "")]
        for r, t in st["table"].items():
            L.append(f"| {r} | " + " | ".join(
                f"{_ms(t[k]['mean'])} ± {_ms(t[k]['hi'] - t[k]['mean'])}" for k in TTFT)
                + f" | {_ms(t['ttft_mean_s']['mean'])} | {t['token_hit_rate']['mean']:.3f} | "
                f"{t['imbalance']['mean']:.2f} | {t['errors']['mean']:.1f} |"
                + (f" {t[CPU]['mean']:.1f} |" if cpu else ""))
        if st["vs"]:
            L += ["", "| CachePilot − | p50 | p90 | p99 | hit rate |", "|---|---|---|---|---|"]
            for r, d in st["vs"].items():
                cells = [f"{d[k]['rel']:+.0%} [{d[k]['rel_lo']:+.0%}, {d[k]['rel_hi']:+.0%}] "
                         f"{verdict(d[k])}" for k in TTFT]
                h = d["token_hit_rate"]
                cells.append(f"{h['mean']:+.3f} [{h['lo']:+.3f}, {h['hi']:+.3f}] "
                             f"{verdict(h, lower_better=False)}")
                L.append(f"| {r} | " + " | ".join(cells) + " |")
        if st["bar"]:
            L += ["", "Against the best peer router per measure (the issue's bar: median "
                  "≤ 0.9×, p90 ≤ 1.0×, hit rate ≥ the best peer's − 1 point):", ""]
            for k, b in st["bar"].items():
                fmt = _ms if k != "token_hit_rate" else (lambda x: f"{x:.3f}")
                L.append(f"* {k.replace('ttft_', '').replace('_s', '')}: CachePilot "
                         f"{fmt(b['ours'])} vs {b['best_peer']} {fmt(b['theirs'])}: "
                         f"{'holds' if b['means'] else 'misses'} on the means, "
                         f"{'no significant loss' if b['not_worse'] else 'a significant loss'}")
        L.append("")
    L += [f"![TTFT and hit rate by router, paired differences]({plot_name})", ""]
    return "\n".join(L)


def plot(data: dict[str, Any], stats: dict[str, Any]) -> Figure:
    """A row per workload: TTFT by router (bars: means; dots: seeds), CachePilot's paired
    TTFT differences (% of the other router, 95 % CI), hit rate by router."""
    from cachepilot.lab.plots import paired_differences, plt  # matplotlib, Agg backend

    names = [n for n in stats if n != ALL]
    fig, axes = plt.subplots(len(names), 3, figsize=(15, 4.2 * len(names)), squeeze=False)
    for row, name in zip(axes, names, strict=True):
        st = stats[name]
        routers = list(st["table"])
        x = np.arange(len(routers))
        cells = _cells(data["phases"], name)
        for j, k in enumerate(TTFT):
            off = (j - 1) * 0.27
            row[0].bar(x + off, [st["table"][r][k]["mean"] * 1000 for r in routers],
                       width=0.27, label=k[5:8], alpha=0.7)
            for r_i, r in enumerate(routers):
                ys = [c[r][k] * 1000 for c in cells.values() if r in c and c[r][k]]
                row[0].plot([r_i + off] * len(ys), ys, "k.", ms=3)
        row[0].set_xticks(x, routers, rotation=30, ha="right", fontsize=8)
        row[0].set_ylabel("TTFT (ms)")
        row[0].set_title(f"{name}: TTFT by router")
        row[0].legend(fontsize=8)
        paired_differences(row[1], st["vs"], TTFT,
                           "CachePilot − router, % of router (95 % CI)")
        row[1].set_title(f"{name}: paired TTFT differences")
        row[1].legend(fontsize=8)
        row[2].bar(x, [st["table"][r]["token_hit_rate"]["mean"] for r in routers], alpha=0.7)
        for r_i, r in enumerate(routers):
            ys = [c[r]["token_hit_rate"] for c in cells.values() if r in c]
            row[2].plot([r_i] * len(ys), ys, "k.", ms=4)
        row[2].set_xticks(x, routers, rotation=30, ha="right", fontsize=8)
        row[2].set_ylabel("cached / prompt tokens")
        row[2].set_title(f"{name}: token hit rate (workers' counts)")
        for ax in row:
            ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def pool(runs: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Runs of one study on different seeds as one (``(folder, data)`` each, the data as
    :func:`write_outputs` takes it): their phases and samples together, every cell still
    paired within its own run, so more seeds narrow the intervals. ValueError when the runs
    differ in anything but their seeds, or share a seed."""
    if len(runs) < 2:
        raise ValueError("pooling takes two runs or more")
    first = runs[0][1]["config"]
    seeds: list[int] = []
    for out, data in runs:
        cfg = data["config"]
        differ = sorted(k for k in {*first, *cfg} - {"seeds"} if cfg.get(k) != first.get(k))
        if differ:
            raise ValueError(f"{out}: not the same study as {runs[0][0]} "
                             f"({', '.join(differ)} differ)")
        shared = set(seeds) & set(cfg["seeds"])
        if shared:
            raise ValueError(f"{out}: seeds {sorted(shared)} are in an earlier run too")
        seeds += cfg["seeds"]
    return {"config": {**first, "seeds": seeds},
            "workloads": runs[0][1]["workloads"],
            "phases": [p for _, d in runs for p in d["phases"]],
            "samples": [x for _, d in runs for x in d["samples"]],
            "wall_s": sum(d["wall_s"] for _, d in runs),
            "pooled_from": [{"out": out, "command": d.get("command", "")} for out, d in runs]}


def write_outputs(data: dict[str, Any], output: StudyOutput) -> dict[str, Any]:
    """results.json (config, phases, statistics), samples.json (every request),
    report.md and real_peers.png."""
    stats = analyse(data)
    name = output.figure(plot(data, stats), "real_peers.png", dpi=100)
    output.data("samples.json", data["samples"])
    output.write(report(data, stats, name),
                 {k: v for k, v in data.items() if k != "samples"} | {"stats": stats})
    return stats
