"""The seed-claims studies: every claim of the original study re-measured across seeds.

Parameters are fixed here, once, and documented in docs/simulator.md; nothing below is fitted
to the original's figures. Each (seed, workload) pair is one task: the workload is drawn once
and every policy/weight variant runs on the very same requests (common random numbers), so
policy differences are not confounded with workload draws. Tasks run on a process pool.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cachepilot.core import CostModel, Weights
from cachepilot.sim.engine import EngineConfig
from cachepilot.sim.measures import summarize, ttft_sample
from cachepilot.sim.parallel import process_count, run_tasks
from cachepilot.sim.simulator import SimConfig, Simulator, ideal_ttfts
from cachepilot.sim.stats import ci95, paired
from cachepilot.sim.workloads import Dist, WorkloadSpec, generate

# -- the fixed setup ------------------------------------------------------------------------------
WORKERS = 3
RATE = 20.0  # the original's three workers at 20 requests/s
SATURATING_RATE = 60.0  # 3× RATE: every policy's workers are busy all the time
DURATION = 60.0
# The studies compare routing policies, so the gateway's admission limit (429 beyond 128
# waiting on every worker) is lifted; one extra run shows overlap-only with it in place.
STUDY_COST = CostModel(admission_limit=10**9)
LOAD_WEIGHTS = (0.0, 0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
WEIGHT_FACTORS = (0.5, 2.0)
ALL_POLICIES = ("round_robin", "least_loaded", "overlap_only", "priced",
                "sglang_cache_aware", "kubeai_chwbl", "power_of_two", "dynamo_kv", "gie_default")

WORKLOADS: dict[str, WorkloadSpec] = {
    "shared": WorkloadSpec("shared_prefix", rate=RATE, duration=DURATION),
    "saturated": WorkloadSpec("shared_prefix", rate=SATURATING_RATE, duration=DURATION / 2),
    "hotspot": WorkloadSpec("hotspot", rate=RATE, duration=DURATION),
    "bursty": WorkloadSpec("bursty", rate=RATE, duration=DURATION),
    # Sensitivity of claim 1 to the working set: twice and four times as many groups.
    "shared_x2": WorkloadSpec("shared_prefix", rate=RATE, duration=DURATION, groups=96),
    "shared_x4": WorkloadSpec("shared_prefix", rate=RATE, duration=DURATION, groups=192),
}

# The real-model studies' traffic for two single-slot llama.cpp workers on 2 CPU cores
# (cachepilot.tooling.llamacpp: "shared" is the real-model experiment's, "hotspot" the
# real-peers study's second workload), and such a worker in the simulator: one slot, prefill
# at the ~2.45 ms/token measured on one thread (docs/real-model.md), ~0.1 s of fixed cost
# per step. The peers study runs them on slot engines, where placement overwrites prompts.
LLAMA_WORKLOADS: dict[str, WorkloadSpec] = {
    # Two shared documents of ~550 tokens (~1.7 s cold): two single-slot workers hold both
    # once partitioned, one holds only one; 15 % of requests bring a one-off document.
    "shared": WorkloadSpec("shared_prefix", rate=0.4, groups=2, prefix=Dist(550),
                           suffix=Dist(22), output=Dist(8), p_unique=0.15),
    # One system prompt, then one of 8 documents by Zipf popularity (a few hot, a long tail
    # that two one-slot workers cannot all hold); more work per request: a lower rate.
    "hotspot": WorkloadSpec("hotspot", rate=0.3, system_tokens=60, docs=8,
                            doc=Dist(480, 0.15, 360, 600), zipf_s=1.1,
                            question=Dist(22), output=Dist(8)),
}
LLAMA_ENGINE = EngineConfig(slots=1, num_blocks=256, prefill_ms_per_token=2.45,
                            step_ms=100.0, decode_ms_per_seq=5.0, max_batched_tokens=2048)


@dataclass(frozen=True)
class Variant:
    name: str
    policy: str
    weights: Weights = field(default_factory=Weights)
    cost: CostModel = STUDY_COST
    scrape_interval_s: float = 0.1
    keep_ttft: bool = False


def _sweep(prefix: str) -> list[Variant]:
    return [Variant(f"{prefix}load={w:g}", "priced", Weights(load=w)) for w in LOAD_WEIGHTS
            if w != 1.0]


def plan() -> dict[str, list[Variant]]:
    """Workload → the variants run on it (every seed)."""
    policies = [Variant(p, p, keep_ttft=True) for p in ALL_POLICIES]
    weight_variants = [
        Variant(f"{k}x{f:g}", "priced", Weights(**{k: f}))
        for k in ("prefill", "load", "kv") for f in WEIGHT_FACTORS
    ]
    return {
        "shared": policies + weight_variants,
        "saturated": [Variant("round_robin", "round_robin"), Variant("priced", "priced")],
        "hotspot": policies + _sweep("") + [
            Variant("overlap_only+admission128", "overlap_only", cost=CostModel()),
            Variant("priced@scrape1s", "priced", scrape_interval_s=1.0),
            Variant("priced@scrape4s", "priced", scrape_interval_s=4.0),
        ],
        "bursty": policies + _sweep(""),
        "shared_x2": [Variant("round_robin", "round_robin"), Variant("priced", "priced")],
        "shared_x4": [Variant("round_robin", "round_robin"), Variant("priced", "priced")],
    }


def run_task(task: tuple[str, int]) -> dict[str, Any]:
    """One workload draw and every variant on it."""
    name, seed = task
    wl = generate(WORKLOADS[name], seed)
    ideal = ideal_ttfts(wl)
    out: dict[str, Any] = {"workload": name, "seed": seed, "summary": wl.summary(),
                           "ideal_p50_s": float(np.median(ideal)), "runs": {}}
    for v in plan()[name]:
        cfg = SimConfig(workers=WORKERS, policy=v.policy, weights=v.weights, cost=v.cost,
                        scrape_interval_s=v.scrape_interval_s)
        run = Simulator(cfg).run(wl)
        s = summarize(run, ideal)
        if v.keep_ttft:
            s["ttft_sample"] = ttft_sample(run, 200)
        out["runs"][v.name] = s
    return out


# -- statistics -----------------------------------------------------------------------------------
def _rel(a: float, b: float) -> float:
    return (a - b) / b if b else float("nan")


# -- the claims -----------------------------------------------------------------------------------
@dataclass
class Claim:
    id: str
    text: str
    original: float
    unit: str  # "%", "x", "s", "ms"
    values: list[float]
    note: str = ""
    stats: dict[str, float] = field(default_factory=dict)
    verdict: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def judge(self) -> None:
        self.stats = ci95(self.values)
        m, lo, hi = self.stats["mean"], self.stats["lo"], self.stats["hi"]
        o = self.original
        if not math.isfinite(m):
            self.verdict = "not measurable"
        elif lo <= o <= hi or (o != 0 and abs(m - o) <= 0.25 * abs(o)):
            self.verdict = "reproduced"
        elif self.unit != "%":  # an absolute level: say which side we are on
            self.verdict = "not reproduced: ours " + ("lower" if m < o else "higher")
        elif o != 0 and math.copysign(1, m) == math.copysign(1, o):
            self.verdict = ("same direction, weaker" if abs(m) < abs(o)
                            else "same direction, stronger")
        else:
            self.verdict = "not reproduced"


def _by(results: list[dict], workload: str) -> list[dict]:
    return sorted((r for r in results if r["workload"] == workload), key=lambda r: r["seed"])


def _vals(rows: list[dict], variant: str, key: str) -> list[float]:
    return [r["runs"][variant][key] for r in rows]


def build_claims(results: list[dict]) -> tuple[list[Claim], dict[str, Any]]:
    shared, sat, hot, bur = (_by(results, w) for w in ("shared", "saturated", "hotspot",
                                                         "bursty"))
    claims: list[Claim] = []
    extra: dict[str, Any] = {}

    def rel(rows, key, a="priced", b="round_robin"):
        return [_rel(r["runs"][a][key], r["runs"][b][key]) * 100 for r in rows]

    rr_hit = ci95(_vals(shared, "round_robin", "token_hit_rate"))["mean"]
    pr_hit = ci95(_vals(shared, "priced", "token_hit_rate"))["mean"]
    ws = np.mean([r["summary"]["shared_blocks"] for r in shared]) * 16
    cache = 8192 * 16
    c1note = (f"Round robin hits {rr_hit:.0%} of prompt tokens (priced {pr_hit:.0%}). The "
              f"blocks shared by more than one request total {ws / 1000:.0f}k tokens, "
              f"{ws / cache:.2f}× one worker's KV cache ({cache // 1000}k tokens), so a worker "
              "that sees every prefix still keeps most of them and round robin's median "
              "request is a hit too; the gap shows in the tail (p90 row) and grows with the "
              "working set (sensitivity rows: 2× and 4× the groups).")
    claims.append(Claim("1a", "Priced vs round robin, median TTFT (3 workers, 20 req/s, "
                        "shared prefixes)", -81.0, "%", rel(shared, "ttft_p50_s"), c1note))
    claims.append(Claim("1a-p90", "… same, p90 TTFT (not in the original)", float("nan"), "%",
                        rel(shared, "ttft_p90_s")))
    for w, g in (("shared_x2", 96), ("shared_x4", 192)):
        rows = _by(results, w)
        if rows:
            claims.append(Claim(f"1a-{g}", f"… sensitivity: {g} prefix groups, median TTFT",
                                -81.0, "%", rel(rows, "ttft_p50_s")))
    sat_util = np.mean([np.mean(list(r["runs"]["round_robin"]["utilization"].values()))
                        for r in sat]) if sat else float("nan")
    claims.append(Claim("1b", f"Priced vs round robin, throughput once saturated "
                        f"({SATURATING_RATE:g} req/s offered)", 18.0, "%",
                        rel(sat, "throughput_rps"),
                        f"Round robin's workers are busy {sat_util:.0%} of the run, so both "
                        "policies run at capacity; the gain is the prefill the cache saves."))
    claims.append(Claim("1c", "Priced vs round robin, evictions", -42.0, "%",
                        rel(shared, "evictions"),
                        "Evictions are block reuses in the engine's KV cache; when priced "
                        "partitions the prefixes, each worker's share fits and almost nothing "
                        "is evicted, so the relative drop is close to −100%."))
    claims.append(Claim("2a", "Overlap-only on a hotspot: imbalance (max/mean assigned)", 3.0,
                        "x", _vals(hot, "overlap_only", "imbalance_assigned"),
                        "Every hotspot request starts with the same system prompt, so the first "
                        "worker to see it always has the longest match and takes everything."))
    op50 = _vals(hot, "overlap_only", "ttft_p50_s")
    pp50 = _vals(hot, "priced", "ttft_p50_s")
    claims.append(Claim("2b", "Overlap-only on the hotspot: median TTFT (s)", 35.0, "s", op50,
                        "How far the one hot worker falls behind depends on how far the offered "
                        "load exceeds one worker's capacity and for how long: here 20 req/s of "
                        "mostly cached prompts for 60 s, so its queue grows for a minute. The "
                        "original's 35 s implies a deeper overload or a longer run."))
    claims.append(Claim("2c", "Priced (with load terms) on the hotspot: median TTFT (ms)",
                        219.0, "ms", [x * 1000 for x in pp50],
                        "Our engine model serves a cached prompt in one ~15–30 ms step; the "
                        "original's 219 ms includes costs we do not model (HTTP, tokenization, "
                        "a slower GPU step)."))
    claims.append(Claim("2d", "… overlap-only with the gateway's admission limit (128 waiting) "
                        "in place: imbalance", 3.0, "x",
                        _vals(hot, "overlap_only+admission128", "imbalance_assigned"),
                        "Not in the original: CachePilot's admission filter spills requests "
                        "once a worker's scraped queue reaches 128; the largest queue any scrape "
                        "saw here was "
                        f"{max(_vals(hot, 'overlap_only+admission128', 'max_waiting_scraped'))}"
                        " (the engine runs up to 64 requests at once and queues the rest)."))
    claims.append(Claim("3", "Priced on the hotspot: imbalance (max/mean assigned)", 1.05, "x",
                        _vals(hot, "priced", "imbalance_assigned")))

    # 4: seed variance against weight effects, on the shared-prefix workload, paired by seed.
    base = _vals(shared, "priced", "ttft_p50_s")
    seed_sd = ci95(base)["sd"]
    effects = {}
    for k in ("prefill", "load", "kv"):
        for f in WEIGHT_FACTORS:
            effects[f"{k}×{f:g}"] = paired(_vals(shared, f"{k}x{f:g}", "ttft_p50_s"), base)
    significant = [k for k, e in effects.items() if e["significant"]]
    extra["seed_vs_weight"] = {"seed_sd_s": seed_sd, "effects": effects, "workload": "shared"}
    claims.append(Claim(
        "4", "Weight changes (×0.5, ×2 on prefill, load, kv) with a significant paired effect "
        "on median TTFT (of 6)", float("nan"), "n", [float(len(significant))],
        f"Seed-to-seed SD of the median: {seed_sd * 1000:.2f} ms. Paired differences, variant "
        "− unit weights, mean [95% CI] in ms: "
        + "; ".join(f"{k} {e['mean'] * 1000:+.2f} [{e['lo'] * 1000:+.2f}, "
                    f"{e['hi'] * 1000:+.2f}]" for k, e in effects.items())))
    claims[-1].extra["original_text"] = "the seed mattered more than most weight changes"

    # 5: does the best load weight flip between regimes? Only a paired, significant ordering
    # counts: a weight that beats unit weight in one regime and loses to it in the other.
    sweeps = {}
    for regime, rows in (("bursty", bur), ("hotspot", hot)):
        base5 = _vals(rows, "priced", "ttft_p50_s")
        curve = {}
        for w in LOAD_WEIGHTS:
            name = "priced" if w == 1.0 else f"load={w:g}"
            curve[w] = {"p50": ci95(_vals(rows, name, "ttft_p50_s")),
                        "p90": ci95(_vals(rows, name, "ttft_p90_s")),
                        "vs_unit": paired(_vals(rows, name, "ttft_p50_s"), base5)}
        better = [w for w in LOAD_WEIGHTS if w != 1.0 and curve[w]["vs_unit"]["significant"]
                  and curve[w]["vs_unit"]["mean"] < 0]
        worse = [w for w in LOAD_WEIGHTS if w != 1.0 and curve[w]["vs_unit"]["significant"]
                 and curve[w]["vs_unit"]["mean"] > 0]
        sweeps[regime] = {"curve": {str(k): v for k, v in curve.items()},
                          "better_than_unit": better, "worse_than_unit": worse}
        claims.append(Claim(
            f"5-{regime}", f"Load weights significantly better than unit weight under {regime} "
            "traffic (paired, median TTFT)", float("nan"), "n", [float(len(better))],
            ("better: " + (", ".join(f"{w:g}" for w in better) or "none") + "; worse: "
             + (", ".join(f"{w:g}" for w in worse) or "none") + ". Curve in "
             "weight_sweep.png.")))
    extra["sweeps"] = sweeps
    flips = sorted((set(sweeps["bursty"]["better_than_unit"])
                    & set(sweeps["hotspot"]["worse_than_unit"]))
                   | (set(sweeps["hotspot"]["better_than_unit"])
                      & set(sweeps["bursty"]["worse_than_unit"])))
    extra["flipping_weights"] = flips
    for c in claims:
        c.judge()
    for c in claims:
        if c.id.startswith("5-"):
            c.verdict = (f"flips: {', '.join(f'{w:g}' for w in flips)} beat unit weight in one "
                         "regime and lose in the other" if flips else
                         "no flip: no weight beats unit weight in one regime and loses in the "
                         "other")
        if c.id == "4":
            c.verdict = ("reproduced (most weight changes have no significant effect)"
                         if len(significant) <= 2 else
                         "not reproduced (most weight changes have a significant effect)")
        if c.id == "1a-p90":
            c.verdict = "—"
    return claims, extra


# -- running --------------------------------------------------------------------------------------
def run_all(seeds: int, processes: int | None = None,
            progress: Callable[[int, int, str], None] | None = None) -> dict[str, Any]:
    tasks = [(name, seed) for seed in range(seeds) for name in plan()]
    weight = {n: len(v) for n, v in plan().items()}
    tasks.sort(key=lambda t: -weight[t[0]])
    procs = process_count(processes)
    t0 = time.perf_counter()
    results = run_tasks(run_task, tasks, procs, progress, lambda t: f"{t[0]} seed {t[1]}")
    wall = time.perf_counter() - t0
    sim_requests = sum(s["requests"] for r in results for s in r["runs"].values())
    sim_wall = sum(s["wall_s"] for r in results for s in r["runs"].values())
    return {"results": results, "wall_s": wall, "processes": procs, "seeds": seeds,
            "simulated_requests": sim_requests,
            "sim_requests_per_wall_s": sim_requests / wall if wall > 0 else float("nan"),
            "sim_requests_per_cpu_s": sim_requests / sim_wall if sim_wall > 0 else float("nan"),
            "runs": sum(len(r["runs"]) for r in results)}


def policy_table(results: list[dict], workload: str) -> dict[str, dict[str, Any]]:
    rows = _by(results, workload)
    out = {}
    for p in ALL_POLICIES:
        if not rows or p not in rows[0]["runs"]:
            continue
        out[p] = {k: ci95(_vals(rows, p, k)) for k in
                  ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "throughput_rps",
                   "throughput_out_tps", "token_hit_rate", "evictions", "imbalance_assigned",
                   "imbalance_busy", "p50_over_ideal")}
        out[p]["ideal_p50_s"] = ci95([r["ideal_p50_s"] for r in rows])
    return out


def write_outputs(data: dict[str, Any], out: Path) -> tuple[list[Claim], dict[str, Any]]:
    from cachepilot.sim import plots, report

    out.mkdir(parents=True, exist_ok=True)
    claims, extra = build_claims(data["results"])
    tables = {w: policy_table(data["results"], w) for w in ("shared", "hotspot", "bursty")}
    sat = _by(data["results"], "saturated")
    tables["saturated"] = {p: {k: ci95(_vals(sat, p, k)) for k in
                               ("throughput_rps", "throughput_out_tps", "token_hit_rate")}
                           for p in ("round_robin", "priced")} if sat else {}
    stale = _by(data["results"], "hotspot")
    extra["staleness"] = {v: {k: ci95(_vals(stale, v, k)) for k in
                              ("ttft_p50_s", "ttft_p90_s", "imbalance_assigned")}
                          for v in ("priced", "priced@scrape1s", "priced@scrape4s")}
    doc = {
        "setup": {"workers": WORKERS, "rate": RATE, "saturating_rate": SATURATING_RATE,
                  "duration_s": DURATION, "load_weights": LOAD_WEIGHTS,
                  "workloads": {k: v.to_dict() for k, v in WORKLOADS.items()},
                  "cost": STUDY_COST.to_dict()},
        "speed": {k: data[k] for k in ("wall_s", "processes", "seeds", "simulated_requests",
                                       "sim_requests_per_wall_s", "sim_requests_per_cpu_s",
                                       "runs")},
        "claims": [{"id": c.id, "claim": c.text, "original": c.original, "unit": c.unit,
                    "values": c.values, "ours": c.stats, "verdict": c.verdict, "note": c.note,
                    **c.extra} for c in claims],
        "policies": tables,
        "extra": extra,
    }
    (out / "results.json").write_text(json.dumps(_clean(doc), indent=1))
    figs = plots.make_all(data["results"], extra, tables, out)
    (out / "report.md").write_text(report.render(claims, extra, tables, doc["speed"], figs))
    return claims, doc


def _clean(x: Any) -> Any:
    """JSON without NaN/inf (as null)."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    if isinstance(x, float | np.floating):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    return x


__all__ = ["WORKLOADS", "Variant", "build_claims", "ci95", "plan", "run_all",
           "run_task", "write_outputs"]
