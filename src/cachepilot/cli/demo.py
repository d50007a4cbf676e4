"""``cachepilot demo``: round robin vs CachePilot on the local stack, one table."""

from __future__ import annotations

import sys
from typing import Any

import click
import orjson
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cachepilot.cli.options import check_svg, save_svg, stack_failed, svg_option
from cachepilot.tooling.demo import WORKER_KV_BLOCKS, WORKLOAD, run_demo


@click.command("demo")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object, no table.")
@click.option("--duration", type=click.FloatRange(min=0, min_open=True),
              default=WORKLOAD.duration, show_default=True,
              help="Seconds of traffic per policy.")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=WORKLOAD.rate,
              show_default=True)
@click.option("--decision-log", default=None,
              help="Record CachePilot's decisions here (explain/replay them later).")
@click.option("--flow-control", type=click.Choice(["on", "off"]), default="on",
              show_default=True, help="The gateways' flow control (as `cachepilot gateway`).")
@svg_option
def demo_cmd(as_json: bool, duration: float, rate: float, decision_log: str | None,
             flow_control: str, svg_path: str | None) -> None:
    """Round robin vs CachePilot on the local stack (Envoy + gateway + 3 simulated workers)."""
    check_svg(svg_path, as_json)
    spec = WORKLOAD.with_(duration=duration, rate=rate)
    console = Console(stderr=True)
    kv_tokens = WORKER_KV_BLOCKS * 16
    console.print(f"[bold]CachePilot demo[/]: {spec.groups} shared system prompts of "
                  f"~{spec.prefix.median:,.0f} tokens, {rate:g} req/s for {duration:g}s "
                  f"per policy, through Envoy to 3 simulated vLLM workers with "
                  f"{kv_tokens:,} tokens of KV cache each")
    with Progress(TextColumn("{task.description:<12}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=as_json) as progress:
        try:
            out = run_demo(spec, progress, decision_log,
                           gateway_args=("--flow-control", flow_control))
        except (RuntimeError, TimeoutError, OSError) as exc:
            raise stack_failed(exc, None) from None
    if as_json:
        sys.stdout.write(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode() + "\n")
        return
    table_console = Console(width=max(100, Console().width), record=bool(svg_path))
    _table(out, table_console)
    save_svg(table_console, svg_path, "cachepilot demo")
    if decision_log:
        console.print(f"decisions recorded in {decision_log}: try "
                      f"`cachepilot decisions stats {decision_log}`")


def _table(out: dict[str, Any], console: Console) -> None:
    t = Table(title="Round robin vs CachePilot (same traffic, fresh workers each)")
    t.add_column("policy")
    ms = 1000.0  # the summary is in seconds, the table in ms
    cols = [("requests", "requests", "{:.0f}", 1), ("errors", "errors", "{:.0f}", 1),
            ("ttft_p50_s", "TTFT p50 ms", "{:.0f}", ms),
            ("ttft_p99_s", "TTFT p99 ms", "{:.0f}", ms),
            ("throughput_rps", "req/s", "{:.2f}", 1),
            ("token_hit_rate", "cache hits", "{:.0%}", 1),
            ("imbalance", "imbalance", "{:.2f}", 1)]
    for _, header, _, _ in cols:
        t.add_column(header, justify="right")
    for label in ("round_robin", "cachepilot"):
        row = out[label]
        t.add_row(label, *(fmt.format(row[name] * scale) for name, _, fmt, scale in cols))
    console.print(t)
    rr, cp = out["round_robin"], out["cachepilot"]
    ratio = float(cp["ttft_p50_s"]) / float(rr["ttft_p50_s"])
    console.print(f"median TTFT: CachePilot is {ratio:.0%} of round robin's; "
                  f"per-worker requests: {cp['per_worker']}")
    if cp.get("predictor_rel_error_p50") is not None:
        console.print(f"TTFT predictor, CachePilot phase: median |error| "
                      f"{cp['predictor_rel_error_p50']:.0%} of measured TTFT "
                      f"(p90 {cp['predictor_rel_error_p90']:.0%}, "
                      f"{cp['predictor_observations']} first tokens)")
