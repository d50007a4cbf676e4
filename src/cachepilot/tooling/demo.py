"""The demo behind ``cachepilot demo``: the same prefix-sharing traffic through Envoy twice,
once round robin and once CachePilot, each on a fresh local stack."""

from __future__ import annotations

import asyncio

from rich.progress import Progress

from cachepilot.tooling.loadgen import Summary, Workload, run, summarize
from cachepilot.tooling.stack import LocalStack, StackConfig

PHASES = (("round_robin", "round_robin"), ("cachepilot", "priced"))
# Each worker's KV cache holds 3,072 blocks of 16 tokens (49k tokens): fewer than the shared
# prompts need (32 × ~4k tokens), more than a third of them do. The regime where placement
# matters: round robin makes every worker hold every prompt; locality splits them.
WORKER_KV_BLOCKS = 3072


def run_phase(policy: str, workload: Workload, progress: Progress, task_label: str,
              decision_log: str | None = None) -> tuple[Summary, str]:
    task = progress.add_task(task_label, total=int(workload.rate * workload.duration_s))
    config = StackConfig(policy=policy, decision_log=decision_log,
                         worker_args=("--num-blocks", str(WORKER_KV_BLOCKS)))
    with LocalStack(config) as stack:
        results, wall = asyncio.run(run(stack.url, workload,
                                        lambda done, _n: progress.update(task, completed=done)))
        return summarize(results, wall), str(stack.log_dir)


def run_demo(workload: Workload, progress: Progress, decision_log: str | None = None
             ) -> dict[str, object]:
    """Each phase's summary (and its stack's log directory) by label; CachePilot's decisions
    are recorded in ``decision_log`` if given."""
    out: dict[str, object] = {}
    for label, policy in PHASES:
        log = decision_log if policy == "priced" else None
        summary, logs = run_phase(policy, workload, progress, label, log)
        out[label] = summary.to_dict() | {"logs": logs}
    if decision_log:
        out["decision_log"] = decision_log
    return out
