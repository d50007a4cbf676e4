"""``cachepilot experiment``'s simulator studies: seed-claims, replicas, peers and flow
(registered on the group in :mod:`cachepilot.cli.experiments`), each study imported only
when its command runs."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
import orjson

from cachepilot.cli.study_options import parse_seeds, seeds_callback, study_output

_SEEDS_HELP = ("A range A-B, a list A,B,C or a count N (seeds 0 to N-1). Seeds 0-9 are the "
               "development seeds; the committed results use 100-109.")


def _seeds_option(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--seeds``: which seeds each workload is drawn with (default: the development
    seeds)."""
    return click.option("--seeds", default="0-9", show_default=True,
                        callback=seeds_callback(2), help=_SEEDS_HELP)(f)


@click.command("seed-claims")
@_seeds_option
@click.option("--out", "out_dir", default="seed-claims", show_default=True,
              type=click.Path(file_okay=False))
@click.option("--processes", default=None, type=click.IntRange(1),
              help="Worker processes (default: ≤2).")
@click.pass_context
def seed_claims_cmd(ctx: click.Context, seeds: str, out_dir: str,
                    processes: int | None) -> None:
    """Re-measure the original study's claims across seeds; write report.md, results.json
    and plots to OUT."""
    from rich.console import Console

    from cachepilot.lab import seed_claims

    console = Console(stderr=True)
    t0 = time.perf_counter()
    with _progress() as tick:
        data = seed_claims.run_all(parse_seeds(seeds), processes, tick)
    out = Path(out_dir)
    claims, doc = seed_claims.write_outputs(data, study_output(ctx, out_dir))
    sp = doc["speed"]
    console.print(f"{sp['runs']} runs, {sp['simulated_requests']:,} simulated requests in "
                  f"{sp['wall_s']:.1f} s: {sp['sim_requests_per_wall_s']:,.0f} simulated "
                  f"requests/s of wall time ({sp['sim_requests_per_cpu_s']:,.0f} per CPU s)")
    for c in claims:
        console.print(f"  {c.id:12s} {c.verdict:40s} mean {c.stats.get('mean', float('nan')):.4g}")
    console.print(f"wrote {out / 'report.md'}, {out / 'results.json'} and plots "
                  f"in {time.perf_counter() - t0:.0f} s")


def _mooncake_trace(trace_path: str | None) -> Path | None:
    """--trace, or the shared Mooncake trace beside the checkout when present (None: the
    Mooncake workload is left out, as printed); a file in another format is a usage error."""
    from cachepilot.lab.peers import MOONCAKE
    from cachepilot.sim.traces import TraceFormatError, detect_format

    trace = Path(trace_path) if trace_path else MOONCAKE
    if not trace_path and not trace.exists():
        click.echo(f"no trace at {trace}: the Mooncake workload is left out (--trace FILE)",
                   err=True)
        return None
    try:
        if detect_format(trace) != "mooncake":
            raise click.BadParameter(f"{trace}: not a Mooncake trace", param_hint="--trace")
    except TraceFormatError as exc:
        raise click.BadParameter(str(exc), param_hint="--trace") from None
    return trace


@click.command("replicas")
@_seeds_option
@click.option("--out", "out_dir", default="replicas", show_default=True,
              type=click.Path(file_okay=False))
@click.option("--trace", "trace_path", default=None, type=click.Path(dir_okay=False),
              help="A Mooncake-format trace to include (default: the shared one, if present).")
@click.option("--processes", default=None, type=click.IntRange(1),
              help="Worker processes (default: ≤2).")
@click.pass_context
def replicas_cmd(ctx: click.Context, seeds: str, out_dir: str, trace_path: str | None,
                 processes: int | None) -> None:
    """1, 2, 4 and 8 gateway replicas, alone or sharing their state, against one replica,
    paired by seed; write report.md, results.json and a plot to OUT."""
    from cachepilot.lab import replicas as replicas_study

    trace = _mooncake_trace(trace_path)
    with _progress() as tick:
        data = replicas_study.run_all(parse_seeds(seeds), trace, processes, tick)
    stats = replicas_study.write_outputs(data, study_output(ctx, out_dir, trace_path=trace))
    for name, st in stats.items():
        for case in ("4 alone", "4 synced"):
            d = st[case]["vs_one"]
            click.echo(f"{name:9s} {case:9s} hit {d['token_hit_rate']['mean'] * 100:+5.1f} pt  "
                       f"p90 {d['ttft_p90_s']['rel']:+6.1%}"
                       + ("" if case.endswith("alone") else
                          "  meets" if replicas_study.meets(st) else "  MISSES"))
    click.echo(f"wrote {Path(out_dir) / 'report.md'} in {data['wall_s']:.0f} s", err=True)


@click.command("peers")
@_seeds_option
@click.option("--out", "out_dir", default="peers", show_default=True,
              type=click.Path(file_okay=False))
@click.option("--trace", "trace_path", default=None, type=click.Path(dir_okay=False),
              help="A Mooncake-format trace to include (default: shared/traces/"
                   "mooncake_synthetic_trace.jsonl beside the checkout, when present).")
@click.option("--processes", default=None, type=click.IntRange(1),
              help="Worker processes (default: ≤2).")
@click.option("--json", "as_json", is_flag=True,
              help="Print wins, losses and n.s. counts, raw and Holm-adjusted, as JSON.")
@click.pass_context
def peers_cmd(ctx: click.Context, seeds: str, out_dir: str, trace_path: str | None,
              processes: int | None, as_json: bool) -> None:
    """The default policy against the peer routers' models and round robin, paired by
    seed; write report.md, results.json and plots to OUT."""
    from cachepilot.lab import peers as peers_study
    from cachepilot.lab import peers_report

    trace = _mooncake_trace(trace_path)
    with _progress(quiet=as_json) as tick:
        data = peers_study.run_all(parse_seeds(seeds), trace, processes, tick)
    out = peers_report.write_outputs(data, study_output(ctx, out_dir, trace_path=trace))
    if as_json:
        click.echo(orjson.dumps({**out["summary"], "out": str(Path(out_dir))},
                                option=orjson.OPT_SERIALIZE_NUMPY).decode())
        return
    for name, st in out["stats"].items():
        for peer, d in st["vs"].items():
            click.echo(f"{name:13s} vs {peer:28s} " + "  ".join(
                f"{k[5:8]} {d[k]['rel']:+6.1%} {peers_report.verdict(d[k]).strip('*'):10s}"
                for k in peers_study.METRICS))
    c = out["summary"]["all"]
    click.echo(f"{out['summary']['family']} comparisons: Holm {c['holm']}, raw {c['raw']}")
    click.echo(f"wrote {Path(out_dir) / 'report.md'} in {data['wall_s']:.0f} s", err=True)


@contextmanager
def _progress(quiet: bool = False) -> Iterator[Callable[[int, int, str], None]]:
    """A progress bar on stderr for a study's tasks (none when ``quiet``)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    if quiet:
        yield lambda i, n, what: None
        return
    with Progress("[progress.description]{task.description}", BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True)) as prog:
        task = prog.add_task("simulating", total=None)

        def tick(i: int, n: int, what: str) -> None:
            prog.update(task, completed=i, total=n, description=f"simulating ({what})")

        yield tick


@click.command("flow")
@_seeds_option
@click.option("--schemes", default=None,
              help="Comma list (default: every scheme of cachepilot.lab.flow_study).")
@click.option("--out", "out_dir", default="flow", show_default=True,
              type=click.Path(file_okay=False))
@click.option("--processes", default=None, type=click.IntRange(1),
              help="Worker processes (default: ≤2).")
@click.pass_context
def flow_cmd(ctx: click.Context, seeds: str, schemes: str | None, out_dir: str,
             processes: int | None) -> None:
    """Flow control under a flooding tenant: reject-at-limit, FCFS holding, VTC, llm-d's
    flow control (default and LAS) and ours, paired by seed; write report.md, results.json
    and a plot to OUT."""
    from cachepilot.lab import flow_report, flow_study

    chosen = tuple(schemes.split(",")) if schemes else tuple(flow_study.SCHEMES)
    unknown = [s for s in chosen if s not in flow_study.SCHEMES]
    if unknown:
        raise click.BadParameter(f"unknown {unknown}; known: {', '.join(flow_study.SCHEMES)}",
                                 param_hint="--schemes")
    seed_list = tuple(parse_seeds(seeds))
    t0 = time.perf_counter()
    with _progress() as tick:
        rows = flow_study.run_all(seed_list, chosen, processes, tick)
    path = flow_report.write(study_output(ctx, out_dir), rows, list(chosen), seed_list,
                             time.perf_counter() - t0)
    click.echo(f"wrote {path}", err=True)
