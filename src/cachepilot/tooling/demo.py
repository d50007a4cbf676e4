"""The demo behind ``cachepilot demo``: the same prefix-sharing traffic through Envoy twice,
once round robin and once CachePilot, each on a fresh local stack."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from rich.progress import Progress

from cachepilot.sim.workloads import Dist, SimRequest, WorkloadSpec, generate
from cachepilot.tooling.loadgen import chat_body, run, summarize
from cachepilot.tooling.procs import http_get
from cachepilot.tooling.stack import LocalStack, StackConfig

PHASES = (("round_robin", "round_robin"), ("cachepilot", "priced"))
# Each worker's KV cache holds 3,072 blocks of 16 tokens (49k tokens): fewer than the shared
# prompts need (32 × ~4k tokens), more than a third of them do. The regime where placement
# matters: round robin makes every worker hold every prompt; locality splits them.
WORKER_KV_BLOCKS = 3072
MODEL = "sim-llama-8b"
SEED = 7
# 32 shared system prompts of 4,000 tokens, each request one of them (uniformly) and a
# 100-token question; 32 output tokens; Poisson arrivals at 8/s for 30 s.
WORKLOAD = WorkloadSpec("shared_prefix", rate=8.0, duration=30.0, groups=32,
                        prefix=Dist(4000), suffix=Dist(100), output=Dist(32))


def requests(spec: WorkloadSpec = WORKLOAD, seed: int = SEED) -> list[SimRequest]:
    return generate(spec, seed).requests


def run_phase(policy: str, reqs: list[SimRequest], progress: Progress, task_label: str,
              decision_log: str | None = None, gateway_args: tuple[str, ...] = ()
              ) -> tuple[dict[str, Any], str]:
    task = progress.add_task(task_label, total=len(reqs))
    config = StackConfig(policy=policy, decision_log=decision_log, model=MODEL,
                         worker_args=("--num-blocks", str(WORKER_KV_BLOCKS)),
                         gateway_args=gateway_args)
    bodies = [chat_body(r, MODEL) for r in reqs]
    with LocalStack(config) as stack:
        results, wall = asyncio.run(run(stack.url, [r.arrival for r in reqs], bodies,
                                        lambda done, _n: progress.update(task, completed=done)))
        return summarize(results, wall) | predictor_accuracy(stack), str(stack.log_dir)


def predictor_accuracy(stack: LocalStack) -> dict[str, Any]:
    """The gateway's TTFT predictor over the phase: median and p90 |measured − predicted|,
    relative to the measured TTFT (its ``GET /predictor``)."""
    status, body = http_get(stack.admin_url + "/predictor", timeout=5.0)
    if status != 200:
        return {}
    acc = orjson.loads(body)["accuracy"]["all"]
    if not acc.get("n"):
        return {}
    return {"predictor_rel_error_p50": acc["rel_error_p50"],
            "predictor_rel_error_p90": acc["rel_error_p90"], "predictor_observations": acc["n"]}


def run_demo(spec: WorkloadSpec, progress: Progress, decision_log: str | None = None,
             seed: int = SEED, gateway_args: tuple[str, ...] = ()) -> dict[str, object]:
    """Each phase's summary (and its stack's log directory) by label; CachePilot's decisions
    are recorded in ``decision_log`` if given; ``gateway_args`` go to both gateways."""
    reqs = requests(spec, seed)
    out: dict[str, object] = {}
    for label, policy in PHASES:
        log = decision_log if policy == "priced" else None
        summary, logs = run_phase(policy, reqs, progress, label, log, gateway_args)
        out[label] = summary | {"logs": logs}
    if decision_log:
        out["decision_log"] = decision_log
    return out
