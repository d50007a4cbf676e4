"""``cachepilot experiment``: seed-claims (the simulator studies) and real-model (llama.cpp)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
import orjson

from cachepilot.cli.options import stack_failed
from cachepilot.tooling.llamacpp import (
    PHASES,
    WORKLOAD,
    LlamaWorkerSpec,
    installed,
    run_experiment,
    threads_per_worker,
)
from cachepilot.tooling.llamacpp.routers import ROUTERS
from cachepilot.tooling.llamacpp.study import DEFAULT_ROUTERS, Progress, StudyConfig
from cachepilot.tooling.llamacpp.study import WORKLOADS as STUDY_WORKLOADS
from cachepilot.tooling.llamacpp.workload import REQUESTS, SEED
from cachepilot.tooling.vllm.study import StudyConfig as VllmStudyConfig

_VLLM_REQUESTS = VllmStudyConfig.requests


@click.group("experiment")
def experiment_group() -> None:
    """Studies: seed-claims on the simulator, real-model on llama.cpp workers."""


@experiment_group.command("seed-claims")
@click.option("--seeds", default=10, show_default=True, type=click.IntRange(2, 200))
@click.option("--out", "out_dir", default="seed-claims", show_default=True,
              type=click.Path(file_okay=False))
@click.option("--processes", default=None, type=click.IntRange(1),
              help="Worker processes (default: ≤2).")
def seed_claims_cmd(seeds: int, out_dir: str, processes: int | None) -> None:
    """Re-measure the original study's claims across seeds; write report.md, results.json
    and plots to OUT."""
    from rich.console import Console

    from cachepilot.sim import experiments

    console = Console(stderr=True)
    t0 = time.perf_counter()
    with _progress() as tick:
        data = experiments.run_all(seeds, processes, tick)
    out = Path(out_dir)
    claims, doc = experiments.write_outputs(data, out)
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
    from cachepilot.sim import peers_study
    from cachepilot.sim.traces import TraceFormatError, detect_format

    trace = Path(trace_path) if trace_path else peers_study.MOONCAKE
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


@experiment_group.command("replicas")
@click.option("--seeds", default=10, show_default=True, type=click.IntRange(2, 200))
@click.option("--out", "out_dir", default="replicas", show_default=True,
              type=click.Path(file_okay=False))
@click.option("--trace", "trace_path", default=None, type=click.Path(dir_okay=False),
              help="A Mooncake-format trace to include (default: the shared one, if present).")
@click.option("--processes", default=None, type=click.IntRange(1),
              help="Worker processes (default: ≤2).")
def replicas_cmd(seeds: int, out_dir: str, trace_path: str | None,
                 processes: int | None) -> None:
    """1, 2, 4 and 8 gateway replicas, alone or sharing their state, against one replica,
    paired by seed; write report.md, results.json and a plot to OUT."""
    from cachepilot.sim import replicas_study

    trace = _mooncake_trace(trace_path)
    with _progress() as tick:
        data = replicas_study.run_all(seeds, trace, processes, tick)
    stats = replicas_study.write_outputs(data, Path(out_dir))
    for name, st in stats.items():
        for case in ("4 alone", "4 synced"):
            d = st[case]["vs_one"]
            click.echo(f"{name:9s} {case:9s} hit {d['token_hit_rate']['mean'] * 100:+5.1f} pt  "
                       f"p90 {d['ttft_p90_s']['rel']:+6.1%}"
                       + ("" if case.endswith("alone") else
                          "  meets" if replicas_study.meets(st) else "  MISSES"))
    click.echo(f"wrote {Path(out_dir) / 'report.md'} in {data['wall_s']:.0f} s", err=True)


@experiment_group.command("peers")
@click.option("--seeds", default=10, show_default=True, type=click.IntRange(2, 200))
@click.option("--out", "out_dir", default="peers", show_default=True,
              type=click.Path(file_okay=False))
@click.option("--trace", "trace_path", default=None, type=click.Path(dir_okay=False),
              help="A Mooncake-format trace to include (default: shared/traces/"
                   "mooncake_synthetic_trace.jsonl beside the checkout, when present).")
@click.option("--processes", default=None, type=click.IntRange(1),
              help="Worker processes (default: ≤2).")
def peers_cmd(seeds: int, out_dir: str, trace_path: str | None,
              processes: int | None) -> None:
    """The default policy against the peer routers' models, paired by seed; write
    report.md, results.json and plots to OUT."""
    from cachepilot.sim import peers_study

    trace = _mooncake_trace(trace_path)
    with _progress() as tick:
        data = peers_study.run_all(seeds, trace, processes, tick)
    stats = peers_study.write_outputs(data, Path(out_dir))
    for name, st in stats.items():
        for peer, d in st["vs"].items():
            click.echo(f"{name:9s} vs {peer:18s} " + "  ".join(
                f"{k[5:8]} {d[k]['rel']:+6.1%} {peers_study.verdict(d[k]).strip('*'):5s}"
                for k in peers_study.METRICS))
    click.echo(f"wrote {Path(out_dir) / 'report.md'} in {data['wall_s']:.0f} s", err=True)


@contextmanager
def _progress() -> Iterator[Callable[[int, int, str], None]]:
    """A progress bar on stderr for a study's tasks."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress("[progress.description]{task.description}", BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True)) as prog:
        task = prog.add_task("simulating", total=None)

        def tick(i: int, n: int, what: str) -> None:
            prog.update(task, completed=i, total=n, description=f"simulating ({what})")

        yield tick


def _names(choices: list[str]) -> Callable[[click.Context, click.Parameter, str], list[str]]:
    """A comma-separated list of names, each one of ``choices``."""

    def parse(_ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
        names = [v.strip() for v in value.split(",") if v.strip()]
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise click.BadParameter(f"{', '.join(bad) or 'none given'}: choose from "
                                     f"{', '.join(choices)}", param=param)
        return names

    return parse


@experiment_group.command("flow")
@click.option("--seeds", default="100-109", show_default=True,
              help="Seeds as A-B or a comma list; the defaults were tuned on 0-9.")
@click.option("--schemes", default=None,
              help="Comma list (default: every scheme of cachepilot.sim.flow_study).")
@click.option("--out", "out_dir", default="docs/results/flow", show_default=True,
              type=click.Path(file_okay=False))
@click.option("--processes", default=None, type=click.IntRange(1),
              help="Worker processes (default: ≤2).")
def flow_cmd(seeds: str, schemes: str | None, out_dir: str, processes: int | None) -> None:
    """Flow control under a flooding tenant: reject-at-limit, FCFS holding, VTC, llm-d's
    flow control (default and LAS) and ours, paired by seed; report.md and results.json."""
    from cachepilot.sim import flow_report, flow_study

    chosen = tuple(schemes.split(",")) if schemes else tuple(flow_study.SCHEMES)
    unknown = [s for s in chosen if s not in flow_study.SCHEMES]
    if unknown:
        raise click.BadParameter(f"unknown {unknown}; known: {', '.join(flow_study.SCHEMES)}",
                                 param_hint="--schemes")
    seed_list = _seed_list(seeds)
    t0 = time.perf_counter()
    with _progress() as tick:
        rows = flow_study.run_all(seed_list, chosen, processes, tick)
    command = (f"cachepilot experiment flow --seeds {seeds}"
               + (f" --schemes {schemes}" if schemes else "") + f" --out {out_dir}")
    path = flow_report.write(Path(out_dir), rows, list(chosen), seed_list, command,
                             time.perf_counter() - t0)
    click.echo(f"wrote {path}", err=True)


def _seed_list(text: str) -> tuple[int, ...]:
    """``100-109`` or ``1,2,5`` → seeds (a usage error otherwise)."""
    try:
        if "-" in text:
            lo, hi = (int(x) for x in text.split("-", 1))
            return tuple(range(lo, hi + 1))
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise click.BadParameter(f"expected A-B or a comma list, not {text!r}",
                                 param_hint="--seeds") from None


@experiment_group.command("real-peers")
@click.option("--workloads", default=",".join(STUDY_WORKLOADS), show_default=True,
              callback=_names(list(STUDY_WORKLOADS)), help="Comma-separated.")
@click.option("--routers", default=",".join(DEFAULT_ROUTERS), show_default=True,
              callback=_names(list(ROUTERS)), help=f"Comma-separated, of: {', '.join(ROUTERS)}.")
@click.option("--seeds", type=click.IntRange(1), default=3, show_default=True,
              help="Seeds 11, 12, …: each draws every workload once.")
@click.option("--requests", type=click.IntRange(1), default=StudyConfig.requests,
              show_default=True, help="Per phase (one router, one workload, one seed).")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Arrivals per second (default: each workload's own).")
@click.option("--out", "out_dir", default="results/real-peers", show_default=True,
              type=click.Path(file_okay=False),
              help="report.md, results.json, samples.json, real_peers.png.")
@click.option("--logs", "log_dir", default=None, type=click.Path(file_okay=False),
              help="Every process's log and the gateway's decision logs (default: OUT/logs).")
def real_peers_cmd(workloads: list[str], routers: list[str], seeds: int, requests: int,
                   rate: float | None, out_dir: str, log_dir: str | None) -> None:
    """CachePilot against sglang-router and vllm-router (PyPI) on the same llama.cpp workers
    and requests, paired by (workload, seed); fresh workers for every router's phase."""
    import shlex

    from cachepilot.tooling.llamacpp.routers import peers_installed
    from cachepilot.tooling.llamacpp.study import run_study
    from cachepilot.tooling.llamacpp.study_report import write_outputs

    why = installed() or peers_installed(routers)
    if why:
        raise click.ClickException(why)
    cfg = StudyConfig(workloads=tuple(workloads), seeds=tuple(range(11, 11 + seeds)),
                      routers=tuple(routers), requests=requests, rate=rate)
    out = Path(out_dir)
    command = shlex.join(["cachepilot", "experiment", "real-peers", "--workloads",
                          ",".join(workloads), "--routers", ",".join(routers), "--seeds",
                          str(seeds), "--requests", str(requests),
                          *(["--rate", f"{rate:g}"] if rate else []), "--out", out_dir])
    try:
        with _study_progress() as progress:
            data = run_study(cfg, str(Path(log_dir) if log_dir else out / "logs"), progress)
    except (RuntimeError, TimeoutError, OSError) as exc:
        raise stack_failed(exc, None) from None
    stats = write_outputs(data, out, command)
    for name, st in stats.items():
        for k, b in st["bar"].items():
            click.echo(f"{name:14s} {k:15s} CachePilot {b['ours']:.3f} vs {b['best_peer']} "
                       f"{b['theirs']:.3f}: {'holds' if b['means'] else 'misses'} on the "
                       f"means, {'no significant loss' if b['not_worse'] else 'LOSS'}")
    click.echo(f"wrote {out / 'report.md'} in {data['wall_s'] / 60:.1f} min", err=True)


@contextmanager
def _study_progress() -> Iterator[Progress]:
    """Bars for the study's phases and the current phase's requests; a line per phase."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, TimeElapsedColumn
    from rich.progress import Progress as Bars

    with Bars("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
              TimeElapsedColumn(), console=Console(stderr=True)) as bars:
        phases = bars.add_task("phases", total=None)
        reqs = bars.add_task("requests", total=None)

        class Shown(Progress):
            def phase(self, i: int, n: int, what: str) -> None:
                bars.update(phases, completed=i, total=n, description=f"phase: {what}")
                bars.reset(reqs, total=None)

            def request(self, done: int, total: int) -> None:
                bars.update(reqs, completed=done, total=total, description="answered")

            def note(self, line: str) -> None:
                bars.console.print(line)

        yield Shown()


@experiment_group.command("real-model")
@click.option("--engine", type=click.Choice(["llamacpp", "vllm"]), default="llamacpp",
              show_default=True,
              help="llama.cpp workers, or two real vLLM workers whose KV events feed the "
                   "exact directory (make vllm-venv vllm-model; docs/vllm.md).")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as one JSON object.")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False),
              help="results.json, samples.json, the plots  [default: results/real-model; "
                   "vllm: docs/results/vllm]")
@click.option("--requests", type=click.IntRange(1), default=None,
              help=f"[default: {REQUESTS}; vllm: {_VLLM_REQUESTS} per phase]")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=WORKLOAD.rate,
              show_default=True, help="(llamacpp)")
@click.option("--workers", type=click.IntRange(1), default=2, show_default=True)
@click.option("--seed", type=int, default=SEED, show_default=True, help="(llamacpp)")
@click.option("--seeds", default="1,2,3", show_default=True,
              help="(vllm) Comma-separated: each seed runs round robin and CachePilot on the "
                   "same requests.")
@click.option("--outside", type=click.FloatRange(0, 1, max_open=True), default=0.0,
              show_default=True,
              help="(vllm) Share of requests sent to a random worker behind the directories' "
                   "backs (another gateway, a client bypassing it); the rest are scored.")
@click.option("--logs", "log_dir", default="runs/vllm-study", show_default=True,
              type=click.Path(file_okay=False), help="(vllm) Worker logs and the raw JSON.")
@click.option("--groups", type=click.IntRange(1), default=WORKLOAD.groups,
              show_default=True, help="Shared documents (llamacpp).")
@click.option("--cache-ram", "cache_ram_mib", type=click.IntRange(0),
              default=LlamaWorkerSpec.cache_ram_mib, show_default=True,
              help="Each worker's prompt cache in MiB (0: only the slot; llamacpp).")
@click.option("--slots", type=click.IntRange(1), default=LlamaWorkerSpec.parallel,
              show_default=True, help="llama-server -np per worker (llamacpp).")
def real_model_cmd(engine: str, as_json: bool, out_dir: str | None, requests: int | None,
                   rate: float, workers: int, seed: int, seeds: str, outside: float,
                   log_dir: str, groups: int, cache_ram_mib: int, slots: int) -> None:
    """Does the gateway's hit prediction hold on a real model? Gemma 3 270M on llama.cpp, or
    on vLLM (round robin vs CachePilot, hit prediction with KV events vs routing-learned)."""
    if engine == "vllm":
        _real_model_vllm(seeds, requests or _VLLM_REQUESTS, workers, outside,
                         out_dir or "docs/results/vllm", log_dir, as_json)
        return
    why = installed()
    if why:
        raise click.ClickException(why)
    out_dir = out_dir or "results/real-model"
    requests = requests or REQUESTS
    workload = WORKLOAD.with_(rate=rate, groups=groups)
    spec = LlamaWorkerSpec(threads=threads_per_worker(workers), parallel=slots,
                           cache_ram_mib=cache_ram_mib)
    echo = None if as_json else (lambda m: click.echo(m, err=True))
    try:
        result = run_experiment(Path(out_dir), workload, requests, seed, workers=workers,
                                echo=echo, spec=spec)
    except (RuntimeError, TimeoutError, OSError) as exc:
        raise stack_failed(exc, None) from None
    if as_json:
        click.echo(orjson.dumps(result).decode())
        return
    _table(result)


def _real_model_vllm(seeds: str, requests: int, workers: int, outside: float, out_dir: str,
                     log_dir: str, as_json: bool) -> None:
    """The vLLM study (tooling/vllm/study.py) and its report (tooling/vllm/report.py)."""
    import asyncio
    import shlex

    from cachepilot.tooling.vllm.report import meets, write_outputs
    from cachepilot.tooling.vllm.stack import default_venv, missing
    from cachepilot.tooling.vllm.study import run as run_vllm_study

    why = missing()
    if why:
        raise click.ClickException(why)
    try:
        seed_list = tuple(int(s) for s in seeds.split(",") if s.strip())
    except ValueError:
        raise click.BadParameter(f"{seeds!r}: comma-separated integers",
                                 param_hint="--seeds") from None
    cfg = VllmStudyConfig(seeds=seed_list, requests=requests, workers=workers, outside=outside)
    command = shlex.join(["cachepilot", "experiment", "real-model", "--engine", "vllm",
                          "--seeds", seeds, "--requests", str(requests),
                          *(["--outside", f"{outside:g}"] if outside else []), "--out", out_dir])
    echo = (lambda m: None) if as_json else (lambda m: click.echo(m, err=True))
    try:
        data = asyncio.run(run_vllm_study(cfg, default_venv(), Path(log_dir), echo))
    except (RuntimeError, TimeoutError, OSError) as exc:
        raise stack_failed(exc, log_dir) from None
    (Path(log_dir) / "vllm-study.json").write_bytes(orjson.dumps(data))  # before the report
    pred = write_outputs(data, Path(out_dir), command)
    if as_json:
        click.echo(orjson.dumps({"summary": data["summary"], "prediction": pred}).decode())
        return
    for name, e in pred.items():
        ev, ap = e["events"]["pooled"], e["approximate"]["pooled"]
        h, m = e["ttft_predicted_hit"], e["ttft_predicted_miss"]
        click.echo(f"{name:12s} events P/R {ev['precision']}/{ev['recall']}  approximate P/R "
                   f"{ap['precision']}/{ap['recall']}  TTFT p50 hit {h['p50_s']} s "
                   f"(n={h['n']}) miss {m['p50_s']} s (n={m['n']})")
    click.echo(f"bar (events P and R >= 0.98): {'met' if meets(pred) else 'MISSED'}; "
               f"wrote {Path(out_dir) / 'report.md'} in {data['wall_s'] / 60:.1f} min", err=True)


def _ms(x: float | None) -> str:
    return "–" if x is None or x != x else f"{x * 1000:.0f}"


def _table(result: dict[str, Any]) -> None:
    """The figures per policy; TTFTs in ms (the result's keys are in seconds)."""
    names = [n for n, _ in PHASES]
    click.echo(f"{'':36}" + "".join(f"{n:>26}" for n in names))
    click.echo(f"{'TTFT mean, all (ms)':36}" + "".join(
        f"{_ms(result[n]['ttft_mean_s']):>26}" for n in names))
    click.echo(f"{'TTFT p50 / p90, all (ms)':36}" + "".join(
        f"{_ms(result[n]['ttft_p50_s'])} / {_ms(result[n]['ttft_p90_s'])} "
        f"(n={result[n]['requests'] - result[n]['errors']})".rjust(26) for n in names))
    rows = [("TTFT p50 / p90, predicted hits", "ttft_predicted_hit"),
            ("TTFT p50 / p90, predicted misses", "ttft_predicted_miss")]
    for label, key in rows:
        cells = [f"{_ms(result[n][key]['ttft_p50_s'])} / {_ms(result[n][key]['ttft_p90_s'])} "
                 f"(n={result[n][key]['n']})" for n in names]
        click.echo(f"{label:36}" + "".join(f"{c:>26}" for c in cells))
    for label, key in (("hit precision", "precision"), ("hit recall", "recall"),
                       ("cached share of prompt tokens", "token_hit_rate")):
        click.echo(f"{label:36}" + "".join(f"{result[n][key]!s:>26}" for n in names))
    click.echo(f"plot: {result['plot']}")
