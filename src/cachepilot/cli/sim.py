"""``cachepilot simulate`` (one run) and ``cachepilot experiment seed-claims`` (the studies)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from cachepilot.cli import LazyGroup
from cachepilot.core import Weights
from cachepilot.sim.peers import SIM_POLICIES


@click.command("simulate")
@click.option("--policy", default="priced", show_default=True,
              help="Routing policy (core or peer model).")
@click.option("--workload", "kind", default="shared_prefix", show_default=True,
              type=click.Choice(["shared_prefix", "hotspot", "bursty", "sessions", "trace"]))
@click.option("--rate", default=20.0, show_default=True, help="Mean arrivals per second.")
@click.option("--duration", default=60.0, show_default=True, help="Seconds of arrivals.")
@click.option("--seed", default=0, show_default=True)
@click.option("--workers", default=3, show_default=True)
@click.option("--load-weight", default=1.0, show_default=True)
@click.option("--prefill-weight", default=1.0, show_default=True)
@click.option("--kv-weight", default=1.0, show_default=True)
@click.option("--scrape-interval", default=0.1, show_default=True,
              help="Seconds between metric scrapes (0: fresh at every decision).")
@click.option("--trace", "trace_path", type=click.Path(exists=True, dir_okay=False),
              help="JSONL trace to replay (with --workload trace).")
@click.option("--json", "as_json", is_flag=True, help="Print the measures as JSON.")
def simulate_cmd(policy: str, kind: str, rate: float, duration: float, seed: int, workers: int,
                 load_weight: float, prefill_weight: float, kv_weight: float,
                 scrape_interval: float, trace_path: str | None, as_json: bool) -> None:
    """Simulate one workload through the gateway's router and modelled engines."""
    from cachepilot.sim import SimConfig, Simulator, WorkloadSpec, generate, ideal_ttfts
    from cachepilot.sim.measures import summarize

    if policy not in SIM_POLICIES:
        raise click.BadParameter(f"unknown policy; known: {', '.join(sorted(SIM_POLICIES))}",
                                 param_hint="--policy")
    if kind == "trace" and not trace_path:
        raise click.BadParameter("--workload trace needs --trace FILE", param_hint="--trace")
    spec = WorkloadSpec(kind, rate=rate, duration=duration, path=trace_path or "")
    wl = generate(spec, seed)
    cfg = SimConfig(workers=workers, policy=policy, scrape_interval_s=scrape_interval,
                    weights=Weights(prefill=prefill_weight, load=load_weight, kv=kv_weight))
    run = Simulator(cfg).run(wl)
    s = summarize(run, ideal_ttfts(wl, cfg.engine))
    s["workload"] = wl.summary()
    if as_json:
        click.echo(json.dumps(s, indent=1))
        return
    click.echo(f"{policy} on {kind} (seed {seed}, {len(wl)} requests, {workers} workers)")
    for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ideal_p50_s"):
        click.echo(f"  {k:22s} {s[k] * 1000:10.1f} ms")
    for k in ("throughput_rps", "throughput_out_tps", "token_hit_rate", "evictions",
              "imbalance_assigned", "imbalance_busy", "rejected"):
        click.echo(f"  {k:22s} {s[k]:10.3f}" if isinstance(s[k], float)
                   else f"  {k:22s} {s[k]:10d}")
    click.echo(f"  utilization            {s['utilization']}")
    click.echo(f"  simulator speed        {s['sim_rps']:,.0f} simulated requests / wall s")


# real-model lives with the llama.cpp adapter; imported only when run.
@click.group("experiment", cls=LazyGroup,
             lazy={"real-model": "cachepilot.tooling.llamacpp:real_model_cmd"})
def experiment_group() -> None:
    """Studies: seed-claims on the simulator, real-model on llama.cpp workers."""


@experiment_group.command("seed-claims")
@click.option("--seeds", default=10, show_default=True, type=click.IntRange(2, 200))
@click.option("--out", "out_dir", default="seed-claims", show_default=True,
              type=click.Path(file_okay=False))
@click.option("--processes", default=None, type=int, help="Worker processes (default: ≤2).")
def seed_claims_cmd(seeds: int, out_dir: str, processes: int | None) -> None:
    """Re-measure the original study's claims across seeds; write report.md, results.json
    and plots to OUT."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from cachepilot.sim import experiments

    console = Console(stderr=True)
    t0 = time.perf_counter()
    with Progress("[progress.description]{task.description}", BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=console) as prog:
        task = prog.add_task("simulating", total=None)

        def tick(i: int, n: int, what: str) -> None:
            prog.update(task, completed=i, total=n, description=f"simulating ({what})")

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
