"""``cachepilot simulate``: one workload through the router and modelled engines."""

from __future__ import annotations

import json

import click

from cachepilot.cli.options import policy_option
from cachepilot.core import Weights
from cachepilot.sim.peers import SIM_POLICIES


@click.command("simulate")
@policy_option(SIM_POLICIES, help="Routing policy (live or peer model).")
@click.option("--workload", "kind", default="shared_prefix", show_default=True,
              type=click.Choice(["shared_prefix", "hotspot", "bursty", "sessions", "trace"]))
@click.option("--rate", default=20.0, show_default=True, help="Mean arrivals per second.",
              type=click.FloatRange(min=0, min_open=True))
@click.option("--duration", default=60.0, show_default=True, help="Seconds of arrivals.",
              type=click.FloatRange(min=0, min_open=True))
@click.option("--seed", default=0, show_default=True)
@click.option("--workers", default=3, show_default=True, type=click.IntRange(1))
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

    if kind == "trace" and not trace_path:
        raise click.BadParameter("--workload trace needs --trace FILE", param_hint="--trace")
    spec = WorkloadSpec(kind, rate=rate, duration=duration, path=trace_path or "")
    try:
        wl = generate(spec, seed)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        if not trace_path:
            raise
        why = f"a line has no field {exc}" if isinstance(exc, KeyError) else str(exc)
        raise click.BadParameter(why if why.startswith(trace_path) else
                                 f"{trace_path}: not a JSONL trace ({why})",
                                 param_hint="--trace") from None
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
