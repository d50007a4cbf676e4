"""``cachepilot demo``: the same prefix-sharing traffic through Envoy twice, once round robin
and once CachePilot, each on a fresh local stack, then one table."""

from __future__ import annotations

import asyncio
import sys

import click
import orjson
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

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


@click.command("demo")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object, no table.")
@click.option("--duration", type=float, default=Workload.duration_s, show_default=True,
              help="Seconds of traffic per policy.")
@click.option("--rate", type=float, default=Workload.rate, show_default=True)
@click.option("--decision-log", default=None,
              help="Record CachePilot's decisions here (explain/replay them later).")
def demo_cmd(as_json: bool, duration: float, rate: float, decision_log: str | None) -> None:
    """Round robin vs CachePilot on the local stack (Envoy + gateway + 3 simulated workers)."""
    workload = Workload(duration_s=duration, rate=rate)
    console = Console(stderr=True)
    kv_tokens = WORKER_KV_BLOCKS * 16
    console.print(f"[bold]CachePilot demo[/]: {workload.groups} shared system prompts of "
                  f"~{workload.prefix_chars // 4:,} tokens, {rate:g} req/s for {duration:g}s "
                  f"per policy, through Envoy to 3 simulated vLLM workers with "
                  f"{kv_tokens:,} tokens of KV cache each")
    out: dict[str, dict[str, object]] = {}
    with Progress(TextColumn("{task.description:<12}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=as_json) as progress:
        for label, policy in PHASES:
            log = decision_log if policy == "priced" else None
            summary, logs = run_phase(policy, workload, progress, label, log)
            out[label] = summary.to_dict() | {"logs": logs}
    if decision_log:
        out["decision_log"] = decision_log  # type: ignore[assignment]
    if as_json:
        sys.stdout.write(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode() + "\n")
        return
    _table(out, Console(width=max(100, Console().width)))
    if decision_log:
        console.print(f"decisions recorded in {decision_log}: try "
                      f"`cachepilot decisions stats {decision_log}`")


def _table(out: dict[str, dict[str, object]], console: Console) -> None:
    t = Table(title="Round robin vs CachePilot (same traffic, fresh workers each)")
    t.add_column("policy")
    cols = [("requests", "requests", "{:d}"), ("errors", "errors", "{:d}"),
            ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"), ("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"),
            ("throughput_rps", "req/s", "{:.2f}"), ("cache_hit_rate", "cache hits", "{:.0%}"),
            ("imbalance", "imbalance", "{:.2f}")]
    for _, header, _ in cols:
        t.add_column(header, justify="right")
    for label in ("round_robin", "cachepilot"):
        row = out[label]
        t.add_row(label, *(fmt.format(row[name]) for name, _, fmt in cols))
    console.print(t)
    rr, cp = out["round_robin"], out["cachepilot"]
    ratio = float(cp["ttft_p50_ms"]) / float(rr["ttft_p50_ms"])  # type: ignore[arg-type]
    console.print(f"median TTFT: CachePilot is {ratio:.0%} of round robin's; "
                  f"per-worker requests: {cp['per_worker']}")
