"""``cachepilot demo``: round robin vs CachePilot on the local stack, one table."""

from __future__ import annotations

import sys
from typing import Any

import click
import orjson
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cachepilot.cli.options import stack_failed
from cachepilot.tooling.demo import WORKER_KV_BLOCKS, run_demo
from cachepilot.tooling.loadgen import Workload


@click.command("demo")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object, no table.")
@click.option("--duration", type=click.FloatRange(min=0, min_open=True),
              default=Workload.duration_s, show_default=True,
              help="Seconds of traffic per policy.")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=Workload.rate,
              show_default=True)
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
    with Progress(TextColumn("{task.description:<12}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=as_json) as progress:
        try:
            out = run_demo(workload, progress, decision_log)
        except (RuntimeError, TimeoutError, OSError) as exc:
            raise stack_failed(exc, None) from None
    if as_json:
        sys.stdout.write(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode() + "\n")
        return
    _table(out, Console(width=max(100, Console().width)))
    if decision_log:
        console.print(f"decisions recorded in {decision_log}: try "
                      f"`cachepilot decisions stats {decision_log}`")


def _table(out: dict[str, Any], console: Console) -> None:
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
    ratio = float(cp["ttft_p50_ms"]) / float(rr["ttft_p50_ms"])
    console.print(f"median TTFT: CachePilot is {ratio:.0%} of round robin's; "
                  f"per-worker requests: {cp['per_worker']}")
