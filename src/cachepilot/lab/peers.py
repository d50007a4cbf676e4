"""``cachepilot experiment peers``: CachePilot's default policy against the peer routers'
models and round robin, paired by seed, on the study workloads and the Mooncake trace.

Each (workload, seed) task draws the workload once and runs every policy on the very same
requests, so a policy difference is measured seed by seed (:mod:`cachepilot.lab.stats`); the
report (:mod:`.peers_report`) adjusts the study's comparisons together (Holm). The peers are
modelled from the versions the real-worker study runs (:mod:`cachepilot.sim.peers`); the
default policy is the one a live pool runs with no setting.

Seeds: 0–9 are the development seeds (every choice of the routing core was made on them);
the committed results use seeds never used to choose anything (docs/results/peers/).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from cachepilot.core import PoolSpec
from cachepilot.lab.parallel import Progress, run_tasks
from cachepilot.lab.seed_claims.runs import STUDY_COST, WORKERS
from cachepilot.lab.seed_claims.runs import WORKLOADS as CLAIM_WORKLOADS
from cachepilot.sim.engine import EngineConfig
from cachepilot.sim.llamacpp import LLAMA_ENGINE, LLAMA_WORKLOADS
from cachepilot.sim.measures import summarize
from cachepilot.sim.simulator import SimConfig, Simulator
from cachepilot.sim.workloads import Workload, WorkloadSpec, generate

DEFAULT = PoolSpec().policy
# The peer models, as each runs in front of paged (vLLM-like) workers. vllm-router needs
# the workers to tokenise: in front of llama.cpp-like workers it runs without (no affinity).
PEERS = ("sglang_cache_aware", "vllm_cache_aware", "gie_default", "dynamo_kv",
         "kubeai_chwbl", "power_of_two")
VLLM_ON_SLOTS = "vllm_cache_aware_untokenized"
BASELINE = "round_robin"
# On slot engines, also the default without its eviction term: what pricing it buys.
SLOT_ABLATION = "priced_no_eviction"
# Per-policy deployment settings that are the peer's own default: GIE's EPP scrapes its
# endpoints every 50 ms (pkg/epp/server/options.go); the others use the simulator's 100 ms.
POLICY_SETTINGS: dict[str, dict[str, Any]] = {"gie_default": {"scrape_interval_s": 0.05}}
METRICS = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s")
# The workloads the bar is about (paged engines); the llama_* ones are reported too.
CORE_WORKLOADS = ("shared", "hotspot", "bursty", "sessions", "mooncake")
DEV_SEEDS = tuple(range(10))
# Where the project's checkout finds the Mooncake trace (shared/ beside the repository).
MOONCAKE = (Path(__file__).resolve().parents[3].parent / "shared" / "traces"
            / "mooncake_synthetic_trace.jsonl")
# The real-peers study's deployment in the simulator: two one-slot llama.cpp-like workers.
LLAMA_DURATION_S = 400.0  # 120-160 requests a seed
KEPT = (*METRICS, "ttft_mean_s", "token_hit_rate", "imbalance_assigned",
        "predictor_rel_error_p50", "predictor_rel_error_p90", "requests", "wall_s")


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


def policies(cfg: SimConfig) -> tuple[str, ...]:
    """The policies run on a deployment: the default, the peers as they would run in front
    of its workers, round robin, and on slot engines the ablation."""
    if cfg.engine.slots:
        peers = tuple(VLLM_ON_SLOTS if p == "vllm_cache_aware" else p for p in PEERS)
        return (DEFAULT, *peers, BASELINE, SLOT_ABLATION)
    return (DEFAULT, *PEERS, BASELINE)


def run_task(task: tuple[str, int, str]) -> dict[str, Any]:
    name, seed, trace = task
    spec, cfg = workloads(Path(trace) if trace else None, slots=True)[name]
    wl = generate(spec, seed)
    runs = {p: run_policy(cfg, wl, p) for p in policies(cfg)}
    return {"workload": name, "seed": seed, "runs": runs}


def run_policy(cfg: SimConfig, wl: Workload, policy: str) -> dict[str, Any]:
    """``policy`` (with its study settings) serving the drawn workload ``wl`` in the
    deployment ``cfg``: the measures the study keeps."""
    s = summarize(Simulator(replace(cfg, policy=policy, **POLICY_SETTINGS.get(policy, {})))
                  .run(wl))
    return {k: s.get(k) for k in KEPT}


def run_seeded(task: Callable[[tuple[str, int, str]], dict[str, Any]], seeds: Sequence[int],
               trace: Path | None, processes: int | None,
               progress: Progress | None, slots: bool = False,
               names: Sequence[str] | None = None) -> tuple[list[dict[str, Any]], float]:
    """``task`` on every (workload, seed) of ``names`` (default: :func:`workloads`), on a
    process pool: the results and the wall time."""
    names = list(names or workloads(trace, slots))
    # The trace's tasks are the longest: first, so both processes stay busy to the end.
    tasks = [(n, s, str(trace or "")) for n in sorted(names, key=lambda n: n != "mooncake")
             for s in seeds]
    t0 = time.perf_counter()
    results = run_tasks(task, tasks, processes, progress, lambda t: f"{t[0]} seed {t[1]}")
    return results, time.perf_counter() - t0


def run_all(seeds: Sequence[int], trace: Path | None, processes: int | None = None,
            progress: Progress | None = None) -> dict[str, Any]:
    results, wall_s = run_seeded(run_task, seeds, trace, processes, progress, slots=True)
    return {"results": results, "seeds": list(seeds), "wall_s": wall_s,
            "workloads": {n: {"spec": s.to_dict(), "workers": c.workers,
                              "kv_tokens": c.engine.num_blocks * c.engine.block_size,
                              "slots": c.engine.slots,
                              "prefill_ms_per_token": c.engine.prefill_ms_per_token,
                              "policies": list(policies(c))}
                          for n, (s, c) in workloads(trace, slots=True).items()}}
