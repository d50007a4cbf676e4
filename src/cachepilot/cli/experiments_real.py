"""``cachepilot experiment``'s real-worker studies: real-peers and real-model (llama.cpp or
vLLM; registered on the group in :mod:`cachepilot.cli.experiments`), each study imported
only when its command runs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import orjson

from cachepilot.cli.options import stack_failed
from cachepilot.cli.study_options import StudyOption, names, require_extra, study_output

if TYPE_CHECKING:
    from cachepilot.lab.real_peers import Progress

_REAL_PEERS = "cachepilot.lab.real_peers"
_TRAFFIC = "cachepilot.lab.real_traffic"
_LLAMA_SPEC = "cachepilot.tooling.llamacpp.worker:LlamaWorkerSpec"
_ROUTERS = "cachepilot.tooling.llamacpp.routers:ROUTERS"


def _joined(values: tuple[str, ...] | dict[str, Any]) -> str:
    """A study's names (a tuple, or a dict's keys) as the option's comma-separated value."""
    return ",".join(values)


@click.command("real-peers")
@click.option("--workloads", cls=StudyOption, study_default=f"{_REAL_PEERS}:WORKLOADS",
              convert=_joined, callback=names(f"{_REAL_PEERS}:WORKLOADS"),
              help="Comma-separated.")
@click.option("--routers", cls=StudyOption, study_default=f"{_REAL_PEERS}:DEFAULT_ROUTERS",
              convert=_joined, callback=names(_ROUTERS), help_refs={"routers": _ROUTERS},
              help="Comma-separated, of: {routers}.")
@click.option("--seeds", default="3", show_default=True,
              help="N (seeds 11, 12, …), a range A-B or a list a,b,c: each draws every "
                   "workload once. Keep the seeds used while developing apart.")
@click.option("--engine", type=click.Choice(["llamacpp", "vllm"]), default="llamacpp",
              show_default=True,
              help="The workers: llama-server, or vLLM (make vllm-venv vllm-model; started "
                   "once, caches reset between phases).")
@click.option("--api", type=click.Choice(["chat", "completions"]), default="chat",
              show_default=True, help="The OpenAI API the requests use.")
@click.option("--requests", type=click.IntRange(1), cls=StudyOption,
              study_default=f"{_REAL_PEERS}:StudyConfig.requests",
              help="Per phase (one router, one workload, one seed).")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Arrivals per second (default: each workload's own).")
@click.option("--out", "out_dir", default="results/real-peers", show_default=True,
              type=click.Path(file_okay=False),
              help="report.md, results.json, samples.json, real_peers.png.")
@click.option("--logs", "log_dir", default=None, type=click.Path(file_okay=False),
              help="Every process's log and the gateway's decision logs (default: OUT/logs).")
@click.option("--keep-predictor/--fresh-predictor", default=True, show_default=True,
              help="CachePilot's phases share its TTFT predictor's fits (--predictor-state "
                   "under the logs), as one gateway running through the study would; fresh: "
                   "every phase starts from the calibrated prior.")
@click.option("--rewrite-report", is_flag=True,
              help="Run nothing: rewrite OUT's report.md, results.json and plot from the "
                   "results.json and samples.json a run left there (its command kept).")
@click.option("--pool", "pool_dirs", multiple=True, type=click.Path(file_okay=False),
              help="Run nothing: one report in OUT from two or more earlier runs' folders "
                   "(the same study on different seeds; repeat the option).")
@click.pass_context
def real_peers_cmd(ctx: click.Context, workloads: list[str], routers: list[str], seeds: str,
                   engine: str, api: str, requests: int, rate: float | None, out_dir: str,
                   log_dir: str | None, keep_predictor: bool, rewrite_report: bool,
                   pool_dirs: tuple[str, ...]) -> None:
    """CachePilot against sglang-router and vllm-router (PyPI) on the same real workers
    (llama.cpp or vLLM) and requests, paired by (workload, seed); fresh caches for every
    router's phase."""
    from cachepilot.tooling.llamacpp.routers import peers_installed

    if rewrite_report:
        _rewrite_real_peers(Path(out_dir))
        return
    if pool_dirs:
        _pool_real_peers([Path(d) for d in pool_dirs], Path(out_dir))
        return

    if engine == "vllm":
        from cachepilot.tooling.vllm.stack import missing

        why = missing()
    else:
        from cachepilot.tooling.llamacpp import installed

        why = installed()
    why = why or peers_installed(routers)
    if why:
        raise click.ClickException(why)
    from cachepilot.lab.real_peers import StudyConfig, run_study
    from cachepilot.lab.real_peers_report import write_outputs

    cfg = StudyConfig(workloads=tuple(workloads), seeds=seed_list(seeds),
                      routers=tuple(routers), requests=requests, rate=rate, engine=engine,
                      api=api, keep_predictor=keep_predictor)
    out = Path(out_dir)
    output = study_output(ctx, out_dir, log_dir=None)
    try:
        with _study_progress() as progress:
            data = run_study(cfg, str(Path(log_dir) if log_dir else out / "logs"), progress)
    except (RuntimeError, TimeoutError, OSError) as exc:
        raise stack_failed(exc, None) from None
    stats = write_outputs(data, output)
    _echo_bars(stats)
    click.echo(f"wrote {out / 'report.md'} in {data['wall_s'] / 60:.1f} min", err=True)


def _echo_bars(stats: dict[str, Any]) -> None:
    """The issue's bar per workload and measure, a line each."""
    for name, st in stats.items():
        for k, b in st["bar"].items():
            click.echo(f"{name:14s} {k:15s} CachePilot {b['ours']:.3f} vs {b['best_peer']} "
                       f"{b['theirs']:.3f}: {'holds' if b['means'] else 'misses'} on the "
                       f"means, {'no significant loss' if b['not_worse'] else 'LOSS'}")


def _read_real_peers(out: Path) -> dict[str, Any]:
    """An earlier run's data as :func:`write_outputs` takes it (its command kept)."""
    try:
        results = orjson.loads((out / "results.json").read_bytes())
        samples = orjson.loads((out / "samples.json").read_bytes())
        data = {k: v for k, v in results.items() if k != "stats"}
        missing = [k for k in ("command", "config", "phases", "workloads", "wall_s")
                   if k not in data]
        if missing:
            raise KeyError(missing[0])
        return {**data, "samples": samples}
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise click.ClickException(f"{out}: not a real-peers study's output ({exc})") from None


def _rewrite_real_peers(out: Path) -> None:
    """The statistics and report of an earlier run again, from its own data files."""
    from cachepilot.lab.output import StudyOutput
    from cachepilot.lab.real_peers_report import write_outputs

    data = _read_real_peers(out)
    command = data.pop("command")
    write_outputs(data, StudyOutput(out, command))
    click.echo(f"rewrote {out / 'report.md'}", err=True)


def _pool_real_peers(runs: list[Path], out: Path) -> None:
    """One report from several runs of the same study on different seeds."""
    from cachepilot.lab.output import StudyOutput
    from cachepilot.lab.real_peers_report import pool, write_outputs

    if out.resolve() in {r.resolve() for r in runs}:
        raise click.ClickException(f"{out}: the pooled report would overwrite a run it reads; "
                                   "give another --out")
    try:
        data = pool([(str(r), _read_real_peers(r)) for r in runs])
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    command = ("cachepilot experiment real-peers " + " ".join(f"--pool {r}" for r in runs)
               + f" --out {out}")
    stats = write_outputs(data, StudyOutput(out, command))
    _echo_bars(stats)
    click.echo(f"wrote {out / 'report.md'} from {len(runs)} runs", err=True)


def seed_list(text: str, first: int = 11) -> tuple[int, ...]:
    """``N`` (N seeds from ``first``), ``A-B`` (inclusive) or ``a,b,c``."""
    try:
        if "-" in text:
            a, b = (int(x) for x in text.split("-", 1))
            out = tuple(range(a, b + 1))
        elif "," in text:
            out = tuple(int(x) for x in text.split(",") if x.strip())
        else:
            out = tuple(range(first, first + int(text)))
    except ValueError:
        out = ()
    if not out:
        raise click.BadParameter(f"{text!r}: N, A-B or a,b,c", param_hint="--seeds")
    return out


@contextmanager
def _study_progress() -> Iterator[Progress]:
    """Bars for the study's phases and the current phase's requests; a line per phase."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, TimeElapsedColumn
    from rich.progress import Progress as Bars

    from cachepilot.lab.real_peers import Progress

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


@click.command("real-model")
@click.option("--engine", type=click.Choice(["llamacpp", "vllm"]), default="llamacpp",
              show_default=True,
              help="llama.cpp workers, or two real vLLM workers whose KV events feed the "
                   "exact directory (make vllm-venv vllm-model; docs/vllm.md).")
@click.option("--api", type=click.Choice(["completions", "chat"]), default="completions",
              show_default=True,
              help="(vllm) /v1/completions with shared system prompts, the directory in the "
                   "study's process; or /v1/chat/completions sessions through Envoy and the "
                   "gateway (rendered with the workers' chat template).")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as one JSON object.")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False),
              help="report.md, results.json, samples.json, the plots  [default: "
                   "results/real-model; vllm: docs/results/vllm, docs/results/vllm-chat]")
@click.option("--requests", type=click.IntRange(1), default=None, cls=StudyOption,
              help_refs={"llama": f"{_TRAFFIC}:REQUESTS",
                         "vllm": "cachepilot.lab.vllm_study:StudyConfig.requests",
                         "chat": "cachepilot.lab.vllm_chat_study:ChatStudyConfig.requests"},
              help="[default: {llama}; vllm: {vllm} per phase, with --api chat {chat}]")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), cls=StudyOption,
              study_default=f"{_TRAFFIC}:WORKLOAD.rate", help="(llamacpp)")
@click.option("--workers", type=click.IntRange(1), default=2, show_default=True)
@click.option("--seed", type=int, cls=StudyOption, study_default=f"{_TRAFFIC}:SEED",
              help="(llamacpp)")
@click.option("--seeds", default="1,2,3", show_default=True,
              help="(vllm) Comma-separated: each seed runs round robin and CachePilot on the "
                   "same requests.")
@click.option("--outside", type=click.FloatRange(0, 1, max_open=True), default=0.0,
              show_default=True,
              help="(vllm) Share of requests sent to a random worker behind the directories' "
                   "backs (another gateway, a client bypassing it); the rest are scored.")
@click.option("--concurrency", type=click.IntRange(1), cls=StudyOption,
              study_default="cachepilot.lab.vllm_study:StudyConfig.concurrency",
              help="(vllm) Requests in flight.")
@click.option("--logs", "log_dir", default=None, type=click.Path(file_okay=False),
              help="(vllm) Worker logs and the raw JSON.  [default: runs/vllm-study, "
                   "runs/vllm-chat-study]")
@click.option("--groups", type=click.IntRange(1), cls=StudyOption,
              study_default=f"{_TRAFFIC}:WORKLOAD.groups", help="Shared documents (llamacpp).")
@click.option("--cache-ram", "cache_ram_mib", type=click.IntRange(0), cls=StudyOption,
              study_default=f"{_LLAMA_SPEC}.cache_ram_mib",
              help="Each worker's prompt cache in MiB (0: only the slot; llamacpp).")
@click.option("--slots", type=click.IntRange(1), cls=StudyOption,
              study_default=f"{_LLAMA_SPEC}.parallel",
              help="llama-server -np per worker (llamacpp).")
@click.pass_context
def real_model_cmd(ctx: click.Context, engine: str, api: str, as_json: bool,
                   out_dir: str | None, requests: int | None, rate: float, workers: int,
                   seed: int, seeds: str, outside: float, concurrency: int,
                   log_dir: str | None, groups: int, cache_ram_mib: int, slots: int) -> None:
    """Does the gateway's hit prediction hold on a real model? Gemma 3 270M on llama.cpp, or
    on vLLM (round robin vs CachePilot, hit prediction with KV events vs routing-learned;
    completions, or chat through the gateway)."""
    if engine == "vllm":
        chat = api == "chat"
        _real_model_vllm(ctx, api, seeds, requests, workers, outside, concurrency,
                         out_dir or ("docs/results/vllm-chat" if chat else "docs/results/vllm"),
                         log_dir or ("runs/vllm-chat-study" if chat else "runs/vllm-study"),
                         as_json)
        return
    from cachepilot.tooling.llamacpp import LlamaWorkerSpec, installed, threads_per_worker

    why = installed()
    if why:
        raise click.ClickException(why)
    from cachepilot.lab.real_model import run_experiment
    from cachepilot.lab.real_traffic import REQUESTS, WORKLOAD

    out_dir = out_dir or "results/real-model"
    requests = requests or REQUESTS
    workload = WORKLOAD.with_(rate=rate, groups=groups)
    spec = LlamaWorkerSpec(threads=threads_per_worker(workers), parallel=slots,
                           cache_ram_mib=cache_ram_mib)
    echo = None if as_json else (lambda m: click.echo(m, err=True))
    output = study_output(ctx, out_dir, out_dir=out_dir, requests=requests, seeds=None,
                     outside=None, log_dir=None, api=None, concurrency=None)
    try:
        result = run_experiment(output, workload, requests, seed, workers=workers,
                                echo=echo, spec=spec)
    except (RuntimeError, TimeoutError, OSError) as exc:
        raise stack_failed(exc, None) from None
    if as_json:
        click.echo(orjson.dumps(result).decode())
        return
    _table(result)


def _real_model_vllm(ctx: click.Context, api: str, seeds: str, requests: int | None,
                     workers: int, outside: float, concurrency: int, out_dir: str,
                     log_dir: str, as_json: bool) -> None:
    """The vLLM studies (lab/vllm_study.py, lab/vllm_chat_study.py) and their report
    (lab/vllm_report.py)."""
    import asyncio

    require_extra("vllm", "httpx", "tokenizers")
    from cachepilot.tooling.vllm.stack import default_venv, missing

    why = missing()
    if why:
        raise click.ClickException(why)
    try:
        seed_list = tuple(int(s) for s in seeds.split(",") if s.strip())
    except ValueError:
        raise click.BadParameter(f"{seeds!r}: comma-separated integers",
                                 param_hint="--seeds") from None
    from cachepilot.lab.vllm_report import bar_for, meets, write_outputs

    if api == "chat":
        from cachepilot.lab.vllm_chat_study import ChatStudyConfig as Config
        from cachepilot.lab.vllm_chat_study import run
    else:
        from cachepilot.lab.vllm_study import StudyConfig as Config
        from cachepilot.lab.vllm_study import run

    requests = requests or Config.requests
    cfg = Config(seeds=seed_list, requests=requests, workers=workers, outside=outside,
                 concurrency=concurrency)
    llama_only = dict.fromkeys(("rate", "seed", "groups", "cache_ram_mib", "slots"))
    output = study_output(ctx, out_dir, out_dir=out_dir, requests=requests, log_dir=None,
                     **llama_only)  # where the logs go does not change the results
    echo = (lambda m: None) if as_json else (lambda m: click.echo(m, err=True))
    try:
        data = asyncio.run(run(cfg, default_venv(), Path(log_dir), echo))
    except (RuntimeError, TimeoutError, OSError) as exc:
        raise stack_failed(exc, log_dir) from None
    (Path(log_dir) / "vllm-study.json").write_bytes(orjson.dumps(data))  # before the report
    pred = write_outputs(data, output)
    if as_json:
        click.echo(orjson.dumps({"summary": data["summary"], "prediction": pred}).decode())
        return
    for name, e in pred.items():
        ev, ap = e["events"]["pooled"], e["approximate"]["pooled"]
        h, m = e["ttft_predicted_hit"], e["ttft_predicted_miss"]
        click.echo(f"{name:12s} events P/R {ev['precision']}/{ev['recall']}  approximate P/R "
                   f"{ap['precision']}/{ap['recall']}  TTFT p50 hit {h['p50_s']} s "
                   f"(n={h['n']}) miss {m['p50_s']} s (n={m['n']})")
    bar = bar_for(data["config"])
    click.echo(f"bar (events P and R >= {bar:.2f}): {'met' if meets(pred, bar) else 'MISSED'}; "
               f"wrote {Path(out_dir) / 'report.md'} in {data['wall_s'] / 60:.1f} min", err=True)


def _table(result: dict[str, Any]) -> None:
    """The figures per policy (TTFTs in ms), as the report's table."""
    from cachepilot.lab.real_model import PHASES, rows

    click.echo(f"{'':36}" + "".join(f"{n:>26}" for n, _ in PHASES))
    for label, cells in rows(result):
        click.echo(f"{label:36}" + "".join(f"{c:>26}" for c in cells))
    click.echo(f"plot: {result['plot']}")
