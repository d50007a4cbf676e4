"""``cachepilot experiment peers``: CachePilot's default policy against the peer routers'
models, paired by seed, on the study workloads and the Mooncake trace.

Each (workload, seed) task draws the workload once and runs every policy on the very same
requests, so a policy difference is measured seed by seed (:func:`cachepilot.lab.stats.paired`)
and called a finding only when its 95 % interval excludes zero. The peers are modelled from
their own code (docs/simulator.md cites each file); the default policy is the one a live pool
runs with no setting.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from cachepilot.core import PoolSpec
from cachepilot.lab.output import StudyOutput
from cachepilot.lab.parallel import Progress, run_tasks
from cachepilot.lab.plots import paired_differences, plt
from cachepilot.lab.seed_claims.runs import STUDY_COST, WORKERS
from cachepilot.lab.seed_claims.runs import WORKLOADS as CLAIM_WORKLOADS
from cachepilot.lab.stats import ci95, paired
from cachepilot.sim.engine import EngineConfig
from cachepilot.sim.llamacpp import LLAMA_ENGINE, LLAMA_WORKLOADS
from cachepilot.sim.measures import summarize
from cachepilot.sim.simulator import SimConfig, Simulator
from cachepilot.sim.workloads import WorkloadSpec, generate

DEFAULT = PoolSpec().policy
PEERS = ("sglang_cache_aware", "gie_default", "dynamo_kv", "kubeai_chwbl", "power_of_two")
POLICIES = (DEFAULT, *PEERS, "round_robin")
# On slot engines, also the default without its eviction term: what pricing it buys.
SLOT_ABLATION = "priced_no_eviction"
METRICS = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s")
# Where the project's checkout finds the Mooncake trace (shared/ beside the repository).
MOONCAKE = (Path(__file__).resolve().parents[3].parent / "shared" / "traces"
            / "mooncake_synthetic_trace.jsonl")


# The real-peers study's deployment in the simulator: two one-slot llama.cpp-like workers.
LLAMA_DURATION_S = 400.0  # 120-160 requests a seed


def workloads(trace: Path | None, slots: bool = False
              ) -> dict[str, tuple[WorkloadSpec, SimConfig]]:
    """Name → (workload, deployment). The Mooncake trace's prompts (15k tokens on average,
    up to 191k) need engines with 262k tokens of KV and eight of them to serve its rate;
    each seed keeps a quarter of its prefix groups at four times the speed (same load).
    With ``slots``, also the real-peers study's two workloads on two simulated one-slot
    llama.cpp workers (``llama_shared``, ``llama_hotspot``)."""
    base = SimConfig(workers=WORKERS, cost=STUDY_COST)
    out = {name: (CLAIM_WORKLOADS[name], base) for name in ("shared", "hotspot", "bursty")}
    out["sessions"] = (WorkloadSpec("sessions", rate=8.0, duration=60.0), base)
    if trace is not None:
        out["mooncake"] = (WorkloadSpec("trace", path=str(trace), rate_scale=4.0, sample=0.25),
                           replace(base, workers=8, engine=EngineConfig(num_blocks=16384)))
    if slots:
        llama = replace(base, workers=2, engine=LLAMA_ENGINE)
        for name, spec in LLAMA_WORKLOADS.items():
            out[f"llama_{name}"] = (spec.with_(duration=LLAMA_DURATION_S), llama)
    return out


def run_task(task: tuple[str, int, str]) -> dict[str, Any]:
    name, seed, trace = task
    spec, cfg = workloads(Path(trace) if trace else None, slots=True)[name]
    wl = generate(spec, seed)
    runs = {}
    for p in (*POLICIES, SLOT_ABLATION) if cfg.engine.slots else POLICIES:
        s = summarize(Simulator(replace(cfg, policy=p)).run(wl))
        runs[p] = {k: s.get(k) for k in (*METRICS, "ttft_mean_s", "token_hit_rate",
                                         "imbalance_assigned", "predictor_rel_error_p50",
                                         "predictor_rel_error_p90", "requests", "wall_s")}
    return {"workload": name, "seed": seed, "runs": runs}


def run_seeded(task: Callable[[tuple[str, int, str]], dict[str, Any]], seeds: int,
               trace: Path | None, processes: int | None,
               progress: Progress | None, slots: bool = False
               ) -> tuple[list[dict[str, Any]], float]:
    """``task`` on every (workload, seed) of :func:`workloads`, on a process pool: the
    results and the wall time."""
    names = list(workloads(trace, slots))
    # The trace's tasks are the longest: first, so both processes stay busy to the end.
    tasks = [(n, s, str(trace or "")) for n in sorted(names, key=lambda n: n != "mooncake")
             for s in range(seeds)]
    t0 = time.perf_counter()
    results = run_tasks(task, tasks, processes, progress, lambda t: f"{t[0]} seed {t[1]}")
    return results, time.perf_counter() - t0


def run_all(seeds: int, trace: Path | None, processes: int | None = None,
            progress: Progress | None = None) -> dict[str, Any]:
    results, wall_s = run_seeded(run_task, seeds, trace, processes, progress, slots=True)
    return {"results": results, "seeds": seeds, "wall_s": wall_s,
            "workloads": {n: {"spec": s.to_dict(), "workers": c.workers,
                              "kv_tokens": c.engine.num_blocks * c.engine.block_size,
                              "slots": c.engine.slots,
                              "prefill_ms_per_token": c.engine.prefill_ms_per_token}
                          for n, (s, c) in workloads(trace, slots=True).items()}}


def analyse(data: dict[str, Any]) -> dict[str, Any]:
    """Per workload: each policy's means with intervals, and the default's paired
    difference from every other policy for p50, p90 and p99."""
    out: dict[str, Any] = {}
    for name in data["workloads"]:
        rows = sorted((r for r in data["results"] if r["workload"] == name),
                      key=lambda r: r["seed"])
        if not rows:
            continue

        def vals(p: str, k: str, rows: list[dict] = rows) -> list[float]:
            return [r["runs"][p][k] for r in rows]

        table = {p: {k: ci95(vals(p, k)) for k in (*METRICS, "token_hit_rate",
                                                  "imbalance_assigned",
                                                  "predictor_rel_error_p50")}
                 for p in rows[0]["runs"]}
        diffs = {p: {k: paired(vals(DEFAULT, k), vals(p, k)) for k in METRICS}
                 for p in rows[0]["runs"] if p != DEFAULT}
        out[name] = {"table": table, "vs": diffs}
    return out


def verdict(d: dict[str, Any]) -> str:
    if not d["significant"]:
        return "n.s."
    return "**wins**" if d["mean"] < 0 else "**loses**"


def report(data: dict[str, Any], stats: dict[str, Any], figs: list[str]) -> str:
    n_req = sum(run["requests"] for r in data["results"] for run in r["runs"].values())
    L = ["# CachePilot's default policy against the peer routers' models", "",
         f"{data['seeds']} seeds, {len(data['results'])} "
         f"(workload, seed) tasks, {n_req:,} simulated requests in {data['wall_s']:.0f} s.",
         "",
         f"Default policy: `{DEFAULT}` (the lowest predicted TTFT, each worker's model learned "
         "online, plus the congestion its prefill causes). Peers are "
         "modelled from their own code (docs/simulator.md). Each seed draws the workload once "
         "and every policy serves the same requests; a difference is the default's minus the "
         "peer's, mean over seeds with its paired 95% interval, relative to the peer's mean: "
         "**wins** / **loses** only when the interval excludes zero, n.s. otherwise. On the "
         "slot-engine workloads (`llama_*`, llama.cpp-like workers) one more row, "
         f"`{SLOT_ABLATION}`, is the default without its eviction term: an ablation, not a "
         "peer.", ""]
    for name, st in stats.items():
        w = data["workloads"][name]
        spec = w["spec"]
        what = (f"trace {Path(spec['path']).name}, ×{spec['rate_scale']:g} speed, "
                f"{spec['sample']:.0%} of its prefix groups per seed" if spec["kind"] == "trace"
                else f"{spec['kind']}, {spec['rate']:g} req/s for {spec['duration']:g} s")
        kv = (f"{w['kv_tokens']:,} tokens of KV each" if not w.get("slots") else
              f"{w['slots']} slot(s) of {w['kv_tokens'] // w['slots']:,} tokens each, "
              f"llama.cpp-like (prefill {w['prefill_ms_per_token']:g} ms/token)")
        L += [f"## {name}", "", f"{what}; {w['workers']} workers with {kv}.", "",
              "| policy | p50 ms | p90 ms | p99 ms | token hit rate | imbalance | "
              "predictor median \\|error\\| |", "|---|---|---|---|---|---|---|"]
        for p, t in st["table"].items():
            L.append(f"| {p} | " + " | ".join(f"{t[k]['mean'] * 1000:.1f}" for k in METRICS)
                     + f" | {t['token_hit_rate']['mean']:.3f} | "
                     f"{t['imbalance_assigned']['mean']:.2f} | "
                     f"{t['predictor_rel_error_p50']['mean']:.1%} |")
        L += ["", f"| {DEFAULT} − peer | p50 | p90 | p99 |", "|---|---|---|---|"]
        for p, d in st["vs"].items():
            L.append(f"| {p} | " + " | ".join(
                f"{d[k]['rel']:+.1%} [{d[k]['rel_lo']:+.1%}, {d[k]['rel_hi']:+.1%}] "
                f"{verdict(d[k])}" for k in METRICS) + " |")
        L.append("")
    L += ["## Plots", ""] + [f"![{f}]({f})" for f in figs] + [""]
    return "\n".join(L)


def _label(metric: str) -> str:
    return metric.replace("ttft_", "").replace("_s", "")


def _paired_panel(ax: Any, st: dict[str, Any]) -> None:
    paired_differences(ax, st["vs"], METRICS, f"{DEFAULT} − peer, % of peer (95% CI)")
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
    """The statistics, the plots, report.md and results.json."""
    stats = analyse(data)
    figs = plot(stats, output)
    output.write(report(data, stats, figs),
                 {"seeds": data["seeds"], "wall_s": data["wall_s"], "default": DEFAULT,
                  "workloads": data["workloads"], "stats": stats, "results": data["results"]})
    return stats

