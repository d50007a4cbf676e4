"""``cachepilot gateway`` and ``cachepilot envoy-config``."""

from __future__ import annotations

import asyncio
import logging
import sys

import click

from cachepilot.core import cost
from cachepilot.core.cost import Weights
from cachepilot.core.fingerprint import BlockConfig, load_tokenizer
from cachepilot.core.policies import LIVE_POLICIES
from cachepilot.core.router import Router, static_router


def parse_weights(text: str | None) -> Weights:
    """``prefill=1,load=2,kv=0.5`` → Weights; unknown names are an error, not ignored."""
    try:
        return Weights(**cost.parse_weights(text))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--weights") from None


def routing_options(f):  # type: ignore[no-untyped-def]
    """Options shared by every command that builds a router."""
    opts = [
        click.option("--policy", type=click.Choice(sorted(LIVE_POLICIES)), default="priced",
                     show_default=True),
        click.option("--weights", default=None, help="e.g. prefill=1,load=1,kv=1"),
        click.option("--block-size", type=int, default=16, show_default=True),
        click.option("--chars-per-token", type=float, default=4.0, show_default=True),
        click.option("--capacity-blocks", type=int, default=4096, show_default=True,
                     help="Directory capacity per worker until the engine reports its own."),
        click.option("--tokenizer", default=None, type=click.Path(exists=True, dir_okay=False),
                     help="tokenizer.json of the served model: blocks of real tokens."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


@click.command("gateway")
@click.option("--listen", default="127.0.0.1:9002", show_default=True, help="ext_proc gRPC.")
@click.option("--admin-host", default="127.0.0.1", show_default=True)
@click.option("--admin-port", type=int, default=9090, show_default=True)
@click.option("--admin-token", envvar="CACHEPILOT_ADMIN_TOKEN", default=None,
              help="Bearer token for the admin API (required when it is not on loopback).")
@click.option("--workers", default="", help="Static workers, ip:port,ip:port (no Kubernetes).")
@click.option("--kubernetes", is_flag=True,
              help="Pools and workers from CachePilotPools (the operator runs in-process).")
@click.option("--namespace", envvar="POD_NAMESPACE", default="default", show_default=True,
              help="With --kubernetes: the namespace whose pools and pods to watch.")
@click.option("--lease-name", default="cachepilot-gateway", show_default=True,
              help="With --kubernetes: the Lease that picks the replica writing status.")
@click.option("--model", "models", multiple=True, help="Models this pool serves (default: any).")
@click.option("--engine", default="vllm", show_default=True,
              type=click.Choice(["vllm", "sglang", "llamacpp", "sim"]))
@click.option("--scrape-interval", type=float, default=0.25, show_default=True)
@click.option("--max-body-bytes", type=int, default=8 * 1024 * 1024, show_default=True)
@click.option("--decision-log", default=None, help="Record every decision (LMDB directory).")
@click.option("--capture-prompts", is_flag=True,
              help="Also store raw prompt text in the decision log (off: hashes only).")
@click.option("--calibrate/--no-calibrate", default=True, show_default=True,
              help="Fit each worker's prefill and queue costs to measured TTFTs.")
@click.option("--observe-responses/--no-observe-responses", default=True, show_default=True,
              help="As in envoy-config: Envoy streams responses through the gateway.")
@routing_options
def gateway_cmd(listen: str, admin_host: str, admin_port: int, admin_token: str | None,
                workers: str, kubernetes: bool, namespace: str, lease_name: str,
                models: tuple[str, ...], engine: str, scrape_interval: float,
                max_body_bytes: int, decision_log: str | None, capture_prompts: bool,
                calibrate: bool, observe_responses: bool, policy: str, weights: str | None,
                block_size: int, chars_per_token: float, capacity_blocks: int,
                tokenizer: str | None) -> None:
    """Run the ext_proc gateway (Envoy calls it for every request)."""
    from cachepilot.gateway.server import Gateway, GatewayConfig, serve
    from cachepilot.gateway.service import GatewayOptions

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if admin_host not in ("127.0.0.1", "localhost", "::1") and not admin_token:
        raise click.UsageError("the admin API leaves loopback only with --admin-token")
    addrs = [w.strip() for w in workers.split(",") if w.strip()]
    if kubernetes and addrs:
        raise click.UsageError("--workers and --kubernetes exclude each other")
    tok = load_tokenizer(tokenizer) if tokenizer else None
    router = Router(tokenizer=tok) if kubernetes else static_router(
        addrs, policy=policy, weights=parse_weights(weights), models=models,
        block=BlockConfig(block_size, chars_per_token), capacity_blocks=capacity_blocks,
        engine=engine, tokenizer=tok)
    config = GatewayConfig(grpc_address=listen, admin_host=admin_host, admin_port=admin_port,
                           admin_token=admin_token, scrape_interval_s=scrape_interval,
                           scrape=not kubernetes,  # the operator scrapes at each pool's interval
                           decision_log=decision_log, calibrate=calibrate,
                           options=GatewayOptions(max_body_bytes=max_body_bytes,
                                                  capture_prompts=capture_prompts,
                                                  observe_responses=observe_responses))

    def ready(gw: Gateway) -> None:
        click.echo(f"cachepilot gateway ready: ext_proc :{gw.grpc_port}, "
                   f"admin http://{admin_host}:{gw.admin_port}", err=True)

    gateway = Gateway(router, config)

    async def main() -> None:
        if kubernetes:
            from cachepilot.operator import OperatorOptions, run_operator

            gateway.add_task(run_operator(router, namespace=namespace, stop_flag=asyncio.Event(),
                                          options=OperatorOptions(lease_name=lease_name)))
        await serve(gateway, ready)

    asyncio.run(main())


@click.command("envoy-config")
@click.option("--listen-port", type=int, default=8080, show_default=True)
@click.option("--listen-address", default="0.0.0.0", show_default=True)
@click.option("--admin-port", type=int, default=9901, show_default=True)
@click.option("--ext-proc", default="127.0.0.1:9002", show_default=True, help="host:port")
@click.option("--fail-open/--fail-closed", default=False, show_default=True)
@click.option("--fallback", default="", help="host:port,… for fail-open (round robin).")
@click.option("--observe-responses/--no-observe-responses", default=True, show_default=True,
              help="Stream response bodies through the gateway (measured TTFT, cached tokens).")
@click.option("--max-body-bytes", type=int, default=8 * 1024 * 1024, show_default=True)
@click.option("--format", "fmt", type=click.Choice(["yaml", "json"]), default="yaml")
def envoy_config_cmd(listen_port: int, listen_address: str, admin_port: int, ext_proc: str,
                     fail_open: bool, fallback: str, observe_responses: bool,
                     max_body_bytes: int, fmt: str) -> None:
    """Print Envoy's bootstrap for CachePilot."""
    from cachepilot.gateway.envoy_config import EnvoyOptions, _split, render

    host, port = _split(ext_proc)
    try:
        opts = EnvoyOptions(listen_address=listen_address, listen_port=listen_port,
                            admin_port=admin_port, ext_proc_host=host, ext_proc_port=port,
                            fail_open=fail_open,
                            fallback_workers=tuple(x for x in fallback.split(",") if x),
                            observe_responses=observe_responses, max_body_bytes=max_body_bytes)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    sys.stdout.write(render(opts, fmt))
