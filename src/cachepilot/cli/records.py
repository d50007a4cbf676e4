"""``cachepilot explain``, ``cachepilot replay`` and ``cachepilot decisions``."""

from __future__ import annotations

import itertools
from typing import Any

import click
import orjson
from rich.console import Console

from cachepilot.cli.options import (
    check_svg,
    cost_option,
    policy_option,
    save_svg,
    svg_option,
    weights_option,
)
from cachepilot.records.store import LogNotFoundError, Store, open_log
from cachepilot.sim.peers import SIM_POLICIES

LOG_ENV = "CACHEPILOT_DECISION_LOG"


def _open(path: str) -> Store:
    """Open a log for this command; a reader of our own is closed when the command ends."""
    try:
        log = open_log(path)
    except (LogNotFoundError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    if log.readonly:
        click.get_current_context().call_on_close(log.close)
    return log


def _json(obj: Any) -> None:
    click.echo(orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode())


@click.command("explain")
@click.argument("decision_id")
@click.option("--log", "log_path", envvar=LOG_ENV, required=True, metavar="PATH",
              help=f"Decision log directory (default: ${LOG_ENV}).")
@click.option("--json", "as_json", is_flag=True, help="Print the raw record instead.")
@svg_option
def explain_cmd(decision_id: str, log_path: str, as_json: bool, svg_path: str | None) -> None:
    """Why one request went where it did: every candidate's terms, the winner and its margin,
    predicted vs measured TTFT. DECISION_ID is a decision id (the x-cachepilot-decision-id
    response header, `cachepilot decisions list`) or `last`."""
    from cachepilot.records.explain import find, render

    check_svg(svg_path, as_json)
    log = _open(log_path)
    record = find(log, decision_id)
    if record is None:
        raise click.ClickException(f"no decision {decision_id!r} in {log_path} "
                                   f"({len(log)} records; it may have aged out or been dropped)")
    if as_json:
        _json(record)
    else:
        console = Console(record=bool(svg_path))
        render(record, console)
        save_svg(console, svg_path, f"cachepilot explain {decision_id}")


@click.command("replay")
@click.argument("log_path", metavar="LOG")
@policy_option(SIM_POLICIES, default=None,
               help="Policy to re-decide with (default: each record's own; the peer models "
                    "only with --simulate).")
@weights_option(help="Override the recorded weights.")
@cost_option(help="Override cost-model parameters (e.g. prefill_ms_per_token=0.2); the "
                  "priced terms are recomputed from the recorded inputs.")
@click.option("--show", default=5, show_default=True, help="Changed decisions to list.")
@click.option("--json", "as_json", is_flag=True)
@click.option("--simulate", is_flag=True,
              help="Feed the recorded arrivals into the simulator for a counterfactual run.")
def replay_cmd(log_path: str, policy: str | None, weights: str | None, cost: str | None,
               show: int, as_json: bool, simulate: bool) -> None:
    """Re-decide every recorded request under another policy, weights or cost model, from
    the state recorded at the time; report what changes."""
    from cachepilot.core.cost import parse_cost, parse_weights
    from cachepilot.records.replay import replay

    try:
        w = parse_weights(weights)
        c = parse_cost(cost)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    log = _open(log_path)
    if simulate:
        from cachepilot.sim.replay_log import simulate_log

        try:
            result = simulate_log(log, policy=policy, weights=w, cost=c)
        except (ImportError, ValueError) as exc:
            raise click.ClickException(str(exc)) from None
        _json(result)
        return
    try:
        report = replay(log, policy, weights=w, cost=c, keep_changes=show)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    d = report.to_dict()
    if as_json:
        _json(d)
        return
    console = Console()
    what = [f"policy {d['policy']}"] + [f"weights {weights}"] * bool(weights) + \
        [f"cost {cost}"] * bool(cost)
    console.print(f"replayed {d['replayed']} of {d['total']} decisions under {', '.join(what)}"
                  + (f" ({d['skipped']} had no eligible worker)" if d["skipped"] else ""))
    console.print(f"decisions changed: {d['changed']} ({d['changed_pct']:.1f}%)")
    t = d["mean_predicted_ttft_ms"]
    console.print(f"mean predicted TTFT: recorded {t['recorded']:.1f} ms → replayed "
                  f"{t['replayed']:.1f} ms ({t['difference']:+.1f} ms)")
    console.print(f"imbalance (busiest worker's share ÷ mean share): recorded "
                  f"{d['imbalance']['recorded']:.2f} → replayed {d['imbalance']['replayed']:.2f}")
    for addr in d["share"]["recorded"]:
        console.print(f"  {addr}: {d['share']['recorded'][addr]} → {d['share']['replayed'][addr]}")
    for m in d["moves"][:show]:
        console.print(f"  moved {m['from']} → {m['to']}: {m['count']}")
    for ch in d["changes"]:
        console.print(f"  {ch['id']}: {ch['recorded']} → {ch['replayed']} (predicted TTFT "
                      f"{ch['recorded_ttft_ms']:.1f} → {ch['replayed_ttft_ms']:.1f} ms)")
    console.print("static replay: later requests see the recorded state, not the effect of "
                  "changed choices (use --simulate for that)", style="dim")


@click.group("decisions")
def decisions_group() -> None:
    """Inspect a decision log."""


@decisions_group.command("stats")
@click.argument("log_path", metavar="LOG")
@click.option("--plot", "plot_path", default=None, metavar="OUT.png",
              help="Also plot predicted vs measured TTFT and per-worker share.")
@click.option("--json", "as_json", is_flag=True)
def stats_cmd(log_path: str, plot_path: str | None, as_json: bool) -> None:
    """Hit rate predicted vs measured, TTFT prediction error, per-worker share."""
    from cachepilot.records.stats import plot, render, summarize

    log = _open(log_path)
    summary = summarize(log)
    if as_json:
        _json(summary)
    else:
        render(summary, Console())
    if plot_path:
        plot(log, plot_path)
        click.echo(f"plot written to {plot_path}", err=as_json)


@decisions_group.command("list")
@click.argument("log_path", metavar="LOG")
@click.option("-n", "count", default=20, show_default=True, type=click.IntRange(0),
              help="How many (the most recent).")
def list_cmd(log_path: str, count: int) -> None:
    """The most recent decisions: id, chosen worker, predicted and measured TTFT."""
    log = _open(log_path)
    skip = max(0, len(log) - count)
    for rec in itertools.islice(log.records(), skip, None):
        out = rec.get("outcome") or {}
        ttft = out.get("ttft_ms")
        click.echo(f"{rec['id']}\t{rec['time']:.3f}\t{rec['chosen']}\tpredicted "
                   f"{rec['predicted_ttft_ms']:.1f} ms\tmeasured "
                   f"{'–' if ttft is None else f'{ttft:.1f} ms'}\t{rec['reason']}")
