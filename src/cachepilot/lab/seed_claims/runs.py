"""The seed-claims studies' runs: every claim of the original study re-measured across seeds.

Parameters are fixed here, once, and documented in docs/simulator.md; nothing below is fitted
to the original's figures. Each (seed, workload) pair is one task: the workload is drawn once
and every policy/weight variant runs on the very same requests (common random numbers), so
policy differences are not confounded with workload draws. Tasks run on a process pool.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cachepilot.core import CostModel, Weights
from cachepilot.lab.parallel import process_count, run_tasks
from cachepilot.sim.measures import summarize, ttft_sample
from cachepilot.sim.simulator import SimConfig, Simulator, ideal_ttfts
from cachepilot.sim.workloads import WorkloadSpec, generate

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


# -- running --------------------------------------------------------------------------------------
def run_all(seeds: Sequence[int], processes: int | None = None,
            progress: Callable[[int, int, str], None] | None = None) -> dict[str, Any]:
    tasks = [(name, seed) for seed in seeds for name in plan()]
    weight = {n: len(v) for n, v in plan().items()}
    tasks.sort(key=lambda t: -weight[t[0]])
    procs = process_count(processes)
    t0 = time.perf_counter()
    results = run_tasks(run_task, tasks, procs, progress, lambda t: f"{t[0]} seed {t[1]}")
    wall = time.perf_counter() - t0
    sim_requests = sum(s["requests"] for r in results for s in r["runs"].values())
    sim_wall = sum(s["wall_s"] for r in results for s in r["runs"].values())
    return {"results": results, "wall_s": wall, "processes": procs, "seeds": list(seeds),
            "simulated_requests": sim_requests,
            "sim_requests_per_wall_s": sim_requests / wall if wall > 0 else float("nan"),
            "sim_requests_per_cpu_s": sim_requests / sim_wall if sim_wall > 0 else float("nan"),
            "runs": sum(len(r["runs"]) for r in results)}
