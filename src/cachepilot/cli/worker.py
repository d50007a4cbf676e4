"""``cachepilot sim-worker``: one simulated vLLM-compatible worker. Imports no gRPC or kopf."""

from __future__ import annotations

import click

from cachepilot.sim.engine import EngineConfig
from cachepilot.tooling.sim_worker import WorkerConfig, serve

_D = EngineConfig()


@click.command("sim-worker")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--model", default=WorkerConfig().model, show_default=True)
@click.option("--name", default=None, help="Shown in x-worker headers and response ids.")
@click.option("--speed", type=float, default=1.0, show_default=True,
              help="Model seconds per wall second (10 = ten times faster than the modelled GPU).")
@click.option("--num-blocks", type=int, default=_D.num_blocks, show_default=True)
@click.option("--block-size", type=int, default=_D.block_size, show_default=True)
@click.option("--max-batch", type=int, default=_D.max_batch, show_default=True)
@click.option("--max-batched-tokens", type=int, default=_D.max_batched_tokens,
              show_default=True)
@click.option("--prefill-ms-per-token", type=float, default=_D.prefill_ms_per_token,
              show_default=True)
@click.option("--step-ms", type=float, default=_D.step_ms, show_default=True)
@click.option("--chars-per-token", type=float, default=4.0, show_default=True)
@click.option("--kv-events-port", type=click.IntRange(1, 65534), default=None,
              help="Publish KV-cache events as vLLM does (ZMQ on HOST:PORT, replay on PORT+1; "
                   "the gateway's --kv-events-port).")
def sim_worker_cmd(port: int, host: str, model: str, name: str | None, speed: float,
                   num_blocks: int, block_size: int, max_batch: int, max_batched_tokens: int,
                   prefill_ms_per_token: float, step_ms: float, chars_per_token: float,
                   kv_events_port: int | None) -> None:
    """Run a simulated vLLM-compatible worker (continuous batching, prefix cache)."""
    engine = EngineConfig(block_size=block_size, num_blocks=num_blocks, max_batch=max_batch,
                          max_batched_tokens=max_batched_tokens,
                          prefill_ms_per_token=prefill_ms_per_token, step_ms=step_ms)
    cfg = WorkerConfig(model=model, engine=engine, chars_per_token=chars_per_token, speed=speed,
                       name=name or f"sim-{port}")
    try:
        serve(cfg, host, port, kv_events_port)
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror or exc}") \
            from None
