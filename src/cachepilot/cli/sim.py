"""``cachepilot simulate``: one workload through the router and modelled engines."""

from __future__ import annotations

import json

import click

from cachepilot.cli.options import cost_option, policy_option
from cachepilot.core import Weights
from cachepilot.sim.engine import EngineConfig
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
              help="Trace to replay (with --workload trace): CachePilot's JSONL or "
                   "Mooncake's format, detected.")
@click.option("--rate-scale", default=1.0, show_default=True,
              type=click.FloatRange(min=0, min_open=True),
              help="Speed a trace's arrivals up by this factor.")
@click.option("--kv-blocks", default=EngineConfig().num_blocks, show_default=True,
              type=click.IntRange(16), help="KV blocks (16 tokens) of each modelled engine.")
@click.option("--replicas", default=1, show_default=True, type=click.IntRange(1),
              help="Gateway replicas, each with its own routing state.")
@click.option("--sharing", default="random", show_default=True,
              type=click.Choice(["random", "round_robin", "service"]),
              help="How requests reach a replica: at random, in turn, or per client "
                   "connection (a Kubernetes Service).")
@cost_option("Cost-model parameters the router starts from, e.g. full_batch_wait_ms=0 "
             "(see cachepilot.core.cost.CostModel).")
@click.option("--json", "as_json", is_flag=True, help="Print the measures as JSON.")
def simulate_cmd(policy: str, kind: str, rate: float, duration: float, seed: int, workers: int,
                 load_weight: float, prefill_weight: float, kv_weight: float,
                 scrape_interval: float, trace_path: str | None, rate_scale: float,
                 kv_blocks: int, replicas: int, sharing: str, cost: str | None,
                 as_json: bool) -> None:
    """Simulate one workload through the gateway's router and modelled engines."""
    from cachepilot.cli.gateway import parse_cost
    from cachepilot.sim import SimConfig, Simulator, WorkloadSpec, generate, ideal_ttfts
    from cachepilot.sim.measures import summarize

    if kind == "trace" and not trace_path:
        raise click.BadParameter("--workload trace needs --trace FILE", param_hint="--trace")
    spec = WorkloadSpec(kind, rate=rate, duration=duration, path=trace_path or "",
                        rate_scale=rate_scale)
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
                    weights=Weights(prefill=prefill_weight, load=load_weight, kv=kv_weight),
                    cost=parse_cost(cost), engine=EngineConfig(num_blocks=kv_blocks),
                    replicas=replicas,
                    sharing=sharing)
    longest = max((r.prompt_tokens + r.max_tokens for r in wl.requests), default=0)
    if longest > kv_blocks * cfg.engine.block_size:
        raise click.BadParameter(
            f"the longest request needs {longest:,} tokens of KV; an engine has "
            f"{kv_blocks * cfg.engine.block_size:,}: raise --kv-blocks to at least "
            f"{-(-longest // cfg.engine.block_size)}", param_hint="--kv-blocks")
    run = Simulator(cfg).run(wl)
    s = summarize(run, ideal_ttfts(wl, cfg.engine))
    s["workload"] = wl.summary()
    if as_json:
        click.echo(json.dumps(s, indent=1))
        return
    click.echo(f"{policy} on {kind} (seed {seed}, {len(wl)} requests, {workers} workers, "
               f"{replicas} gateway replica{'s' if replicas > 1 else ''})")
    for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ideal_p50_s"):
        click.echo(f"  {k:22s} {s[k] * 1000:10.1f} ms")
    for k in ("throughput_rps", "throughput_out_tps", "token_hit_rate", "evictions",
              "imbalance_assigned", "imbalance_busy", "rejected"):
        click.echo(f"  {k:22s} {s[k]:10.3f}" if isinstance(s[k], float)
                   else f"  {k:22s} {s[k]:10d}")
    click.echo(f"  utilization            {s['utilization']}")
    if "predictor_rel_error_p50" in s:
        click.echo(f"  predictor |error|      {s['predictor_rel_error_p50']:10.1%} median, "
                   f"{s['predictor_rel_error_p90']:.1%} p90 (of measured TTFT)")
    click.echo(f"  simulator speed        {s['sim_rps']:,.0f} simulated requests / wall s")
