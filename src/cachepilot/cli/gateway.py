"""``cachepilot gateway`` and ``cachepilot envoy-config``."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import click

from cachepilot.cli.options import cost_option, policy_option, weights_option
from cachepilot.core import cost as costs
from cachepilot.core.cost import CostModel, Weights
from cachepilot.core.fingerprint import BlockConfig, Tokenizer, load_tokenizer
from cachepilot.core.flow.config import FlowConfig, parse_flow
from cachepilot.core.router import Router, static_router
from cachepilot.core.vllm_prompt import VllmPrompts
from cachepilot.tooling.stack import PortInUseError, check_port_free

# How often each worker's /metrics is scraped by default, by engine. A vLLM scrape is ~52 KB
# of histograms, rendered in Python by the engine's API server and read by the gateway; on
# a CPU worker both come out of the engine's cores, and at 4 Hz two of four runs of
# benchmarks/vllm_scrape_interference.py saw the worker slowed (docs/results/vllm-scrape).
# KV events carry its cache state, and the gateway counts what it sent itself, so 1 s (a
# CachePilotPool's default) loses little. llama.cpp: with nothing to serve, the gateway and
# the workers answering it took 2.2 % of a core at 4 Hz and 1.25 % at 1 Hz (scrapes on
# connections closed after each), sglang-router 0.17 % (benchmarks/llama_idle_cpu.py); on
# 2 cores that comes out of the prefills. The gateway counts what it sent in between.
SCRAPE_INTERVAL_S = {"vllm": 1.0, "llamacpp": 1.0}


def parse_weights(text: str | None) -> Weights:
    """``prefill=1,load=2,kv=0.5`` → Weights; unknown names are an error, not ignored."""
    try:
        return Weights(**costs.parse_weights(text))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--weights") from None


def parse_cost(text: str | None) -> CostModel:
    """``prefill_ms_per_token=0.2,…`` → CostModel."""
    try:
        return CostModel().with_(**costs.parse_cost(text))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--cost") from None


def parse_flow_config(text: str | None, enabled: bool = True) -> FlowConfig:
    """``--flow hold_depth=2,…`` → FlowConfig (a usage error names what was wrong)."""
    try:
        return FlowConfig(enabled=enabled, **parse_flow(text))
    except (TypeError, ValueError) as exc:
        raise click.BadParameter(str(exc), param_hint="--flow") from None


def host_port(text: str, option: str) -> tuple[str, int]:
    """``host:port`` → (host, port), or a usage error naming ``option``."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise click.BadParameter(f"expected host:port, got {text!r}", param_hint=option)
    return host.strip("[]"), int(port)


def prompt_cache_prompts(cache_ram_mib: int, prompt_mib: float) -> int:
    """llama-server's --cache-ram as prompts kept (PoolSpec.prompt_cache): its byte limit
    over one prompt's saved state; -1 (no byte limit) stays -1, 0 (off) stays 0."""
    if cache_ram_mib <= 0:
        return -1 if cache_ram_mib < 0 else 0
    return max(1, int(cache_ram_mib // prompt_mib))


def routing_options(f):  # type: ignore[no-untyped-def]
    """Options shared by every command that builds a router."""
    opts = [
        policy_option(),
        weights_option(),
        cost_option("Cost-model parameters, e.g. prefill_ms_per_token=0.2,"
                    "stale_after_s=15 (defaults describe a 7-8B model on one GPU)."),
        click.option("--block-size", type=int, default=16, show_default=True),
        click.option("--chars-per-token", type=float, default=4.0, show_default=True),
        click.option("--capacity-blocks", type=int, default=4096, show_default=True,
                     help="Directory capacity per worker until the engine reports its own."),
        click.option("--tokenizer", default=None, type=click.Path(exists=True),
                     help="tokenizer.json of the served model, or its folder: blocks of real "
                          "tokens (with --vllm-hash-seed: the engines' own prompts)."),
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
@click.option("--epp-service", default=None, metavar="SERVICE",
              help="With --kubernetes: also watch InferencePools (the CRD must be installed); "
                   "those whose endpointPickerRef names this Service become pools "
                   "(docs/gateway-api.md).")
@click.option("--inference-objectives", "objectives_group", default=None, metavar="GROUP",
              is_flag=False, flag_value="inference.networking.x-k8s.io",
              help="With --kubernetes: watch InferenceObjectives (of this API group; the flag "
                   "alone: inference.networking.x-k8s.io; the CRD must be installed): the "
                   "x-gateway-inference-objective header selects the objective's priority "
                   "band (docs/flow-control.md).")
@click.option("--model", "models", multiple=True, help="Models this pool serves (default: any).")
@click.option("--engine", default="vllm", show_default=True,
              type=click.Choice(["vllm", "sglang", "llamacpp", "sim"]))
@click.option("--llama-cache-ram", type=int, default=8192, show_default=True, metavar="MIB",
              help="llama.cpp workers: their --cache-ram (host-memory prompt cache; "
                   "llama-server's default; 0: off, -1: no byte limit). Not in /props.")
@click.option("--llama-prompt-mib", type=click.FloatRange(min=0.001), default=29.0,
              show_default=True, metavar="MIB",
              help="llama.cpp workers: one saved prompt's state in that cache (Gemma 3 "
                   "270M: ~29 MiB, nearly flat in length).")
@click.option("--llama-min-reuse", type=click.IntRange(min=0), default=0, show_default=True,
              metavar="TOKENS",
              help="llama.cpp workers: a common prefix this short is not reused (a "
                   "sliding-window model's window, e.g. 512 for Gemma 3; 0: any).")
@click.option("--llama-ubatch", type=click.IntRange(min=1), default=512, show_default=True,
              metavar="TOKENS",
              help="llama.cpp workers: their -ub (llama-server's default), where the context "
                   "checkpoints a sliding-window model reuses from fall.")
@click.option("--scrape-interval", type=click.FloatRange(min=0.01), default=None,
              help="Seconds between scrapes of each worker's /metrics [default: 1 for vLLM "
                   "and llama.cpp, whose scrapes take CPU from CPU engines "
                   "(docs/results/vllm-scrape, docs/real-model.md), as a CachePilotPool "
                   "does; 0.25 for the other engines].")
@click.option("--scrape-timeout", type=float, default=1.0, show_default=True,
              help="Seconds a worker's /metrics may take (llama.cpp answers between batches).")
@click.option("--max-body-bytes", type=int, default=8 * 1024 * 1024, show_default=True)
@click.option("--stall-after", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="Seconds a worker may leave its requests without a first byte (answering "
                   "none) before it is taken out of routing until they end (0: never).")
@click.option("--standby", is_flag=True, hidden=True,
              help="Load, then wait for a line on stdin before serving (a supervisor's warm "
                   "spare); end of input exits.")
@click.option("--decision-log", default=None, help="Record every decision (LMDB directory).")
@click.option("--capture-prompts", is_flag=True,
              help="Also store raw prompt text in the decision log (off: hashes only).")
@click.option("--calibrate/--no-calibrate", default=True, show_default=True,
              help="Fit each worker's prefill and queue costs to measured TTFTs.")
@click.option("--predictor-state", default=None, metavar="FILE",
              help="Keep the TTFT predictor's fits here across restarts (read at start, "
                   "saved while they change and at stop): a restart predicts from what the "
                   "last run learned, not from the prior.")
@click.option("--observe-responses/--no-observe-responses", default=True, show_default=True,
              help="As in envoy-config: Envoy streams responses through the gateway.")
@click.option("--protocol", type=click.Choice(["auto", "cachepilot", "epp"]), default="auto",
              show_default=True,
              help="ext_proc protocol: our Envoy config's, the Gateway API Inference "
                   "Extension's endpoint picker protocol (any gateway; docs/epp.md), or auto: "
                   "streams with x-cachepilot-* gRPC metadata are ours, the others EPP.")
@click.option("--kv-events-port", type=click.IntRange(1, 65535), default=None,
              help="vLLM workers publish KV-cache events on this port of their host (replay "
                   "on the next): the directory follows them exactly (docs/vllm.md).")
@click.option("--kv-events-topic", default="kv-events", show_default=True)
@click.option("--vllm-hash-seed", default=None, metavar="PYTHONHASHSEED",
              help="Hash token blocks as vLLM does (sha256_cbor seeded with the workers' "
                   "PYTHONHASHSEED), so fingerprints are the engines' block hashes; needs "
                   "--tokenizer.")
@click.option("--chat-template", default=None, type=click.Path(exists=True, dir_okay=False),
              help="With --vllm-hash-seed: the chat template file the workers were started "
                   "with (vLLM's --chat-template); default: the tokenizer folder's "
                   "chat_template.jinja or tokenizer_config.json's.")
@click.option("--chat-template-content-format", default="auto", show_default=True,
              type=click.Choice(["auto", "string", "openai"]),
              help="As vLLM's flag of that name (auto: detected from the template as vLLM "
                   "does).")
@click.option("--lora-module", "lora_modules", multiple=True, metavar="NAME=PATH",
              help="A LoRA adapter the workers serve, exactly as their --lora-modules names "
                   "it (the path is part of every block hash). Repeatable.")
@click.option("--served-model-name", "served_names", multiple=True, metavar="NAME",
              help="The base model's served name(s): a request for any other model that is "
                   "not a --lora-module is matched approximately (default: any name is the "
                   "base). Repeatable.")
@click.option("--replica-bus", default=None, metavar="nats://HOST:PORT",
              help="Share placements and in-flight requests with the other gateway replicas "
                   "over this NATS server.")
@click.option("--replica-id", default="", help="This replica's name on the bus "
              "(default: host and pid).")
@click.option("--processes", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Gateway processes routing as one (a node's cores add up): all serve "
                   "ext_proc on --listen's port (shared), process i also on that port + 1 + i "
                   "and its admin API on --admin-port + i; they share state over local "
                   "sockets (or --replica-bus). Envoy: envoy-config --ext-proc-processes N.")
@click.option("--replica-subject", default="cachepilot.sync", show_default=True,
              help="NATS subject of this deployment's replicas (one per deployment sharing "
                   "a NATS server).")
@click.option("--flow-control", type=click.Choice(["on", "off"]), default="on",
              show_default=True,
              help="Hold requests no worker should take now (by priority band, fairly across "
                   "tenants) instead of answering 429 at the admission limit; off: the old "
                   "behaviour (docs/flow-control.md).")
@click.option("--flow", "flow_settings", default=None, metavar="NAME=VALUE,…",
              help="Flow-control settings, e.g. hold_depth=2,ttl_s=20,bend_tokens=8192,"
                   "tenant_header=x-team (docs/flow-control.md lists them).")
@routing_options
def gateway_cmd(listen: str, admin_host: str, admin_port: int, admin_token: str | None,
                workers: str, kubernetes: bool, namespace: str, lease_name: str,
                epp_service: str | None, models: tuple[str, ...], engine: str,
                scrape_interval: float | None, scrape_timeout: float, max_body_bytes: int,
                stall_after: float, standby: bool, decision_log: str | None,
                capture_prompts: bool, calibrate: bool, predictor_state: str | None,
                observe_responses: bool, policy: str,
                weights: str | None, cost: str | None, block_size: int, chars_per_token: float,
                capacity_blocks: int, tokenizer: str | None, replica_bus: str | None,
                replica_id: str, replica_subject: str, kv_events_port: int | None,
                kv_events_topic: str, vllm_hash_seed: str | None, protocol: str,
                chat_template: str | None, chat_template_content_format: str,
                lora_modules: tuple[str, ...], served_names: tuple[str, ...],
                processes: int, llama_cache_ram: int, llama_prompt_mib: float,
                llama_min_reuse: int, llama_ubatch: int, flow_control: str,
                flow_settings: str | None, objectives_group: str | None) -> None:
    """Run the ext_proc gateway (Envoy calls it for every request)."""
    from cachepilot.datalayer.kv_events import port_endpoints
    from cachepilot.gateway.director import GatewayOptions
    from cachepilot.gateway.processes import child_argv, current_slot, id_prefix, supervise
    from cachepilot.gateway.server import Gateway, GatewayConfig, serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if admin_host not in ("127.0.0.1", "localhost", "::1") and not admin_token:
        raise click.UsageError("the admin API leaves loopback only with --admin-token")
    addrs = [w.strip() for w in workers.split(",") if w.strip()]
    for addr in addrs:
        host_port(addr, "--workers")
    if kubernetes and addrs:
        raise click.UsageError("--workers and --kubernetes exclude each other")
    if epp_service is not None and not kubernetes:
        raise click.UsageError("--epp-service needs --kubernetes")
    if objectives_group is not None and not kubernetes:
        raise click.UsageError("--inference-objectives needs --kubernetes (without it, use "
                               "the x-cachepilot-priority header)")
    if vllm_hash_seed is not None and not tokenizer:
        raise click.UsageError("--vllm-hash-seed needs --tokenizer (the workers' tokenizer.json)")
    flow = parse_flow_config(flow_settings, flow_control == "on")
    listen_host, listen_port = host_port(listen, "--listen")
    slot = current_slot(processes)
    try:  # on loopback we can tell now; elsewhere the bind itself fails (a spare's ports
        # belong to the gateway it stands in for; a process's, to its siblings)
        for i in range(processes + (processes > 1) if slot is None else 0):
            if listen_host in ("127.0.0.1", "localhost") and not standby:
                check_port_free(listen_port + i if listen_port else 0, "--listen")
            if admin_host in ("127.0.0.1", "localhost") and not standby:
                check_port_free(admin_port + i if admin_port else 0, "--admin-port")
    except PortInUseError as exc:
        raise click.ClickException(str(exc)) from None
    if processes > 1 and slot is None:  # the supervisor (a spare: once it is needed)
        if standby and not sys.stdin.readline():
            return
        raise SystemExit(supervise(child_argv(), processes))
    extra_listen: tuple[str, ...] = ()
    if slot is not None:  # the shared port (SO_REUSEPORT), and this process's own
        if listen_port:
            extra_listen = (f"{listen.rpartition(':')[0]}:{slot.own_port(listen_port)}",)
        admin_port, decision_log = slot.admin_port(admin_port), slot.own_path(decision_log)
        predictor_state = slot.own_path(predictor_state)
    exact_only = {"--chat-template": chat_template, "--lora-module": lora_modules,
                  "--served-model-name": served_names}
    for flag, value in exact_only.items():
        if value and vllm_hash_seed is None:
            raise click.UsageError(f"{flag} goes with --vllm-hash-seed (exact vLLM hashing)")
    tok, prompts = _prompt_path(tokenizer, vllm_hash_seed, chat_template,
                                chat_template_content_format, lora_modules, served_names)
    ids = None if slot is None else id_prefix(slot.index)
    router = Router(tokenizer=tok, prompts=prompts, id_prefix=ids) if kubernetes else \
        static_router(addrs, policy=policy, weights=parse_weights(weights), models=models,
                      block=BlockConfig(block_size, chars_per_token, vllm_seed=vllm_hash_seed),
                      capacity_blocks=capacity_blocks, engine=engine, tokenizer=tok,
                      prompts=prompts, cost=parse_cost(cost), id_prefix=ids,
                      prompt_cache=prompt_cache_prompts(llama_cache_ram, llama_prompt_mib),
                      min_reuse_tokens=llama_min_reuse, ubatch_tokens=llama_ubatch)
    kv_endpoints = None if kv_events_port is None else port_endpoints(
        kv_events_port, kv_events_port + 1, kv_events_topic)
    kv_sources = None
    if kubernetes:  # each pool's spec.kvEvents and its pods say; the flag is the fallback
        from cachepilot.operator import KVEventSources

        kv_endpoints = kv_sources = KVEventSources(fallback=kv_endpoints)
    config = GatewayConfig(grpc_address=listen, admin_host=admin_host, admin_port=admin_port,
                           admin_token=admin_token,
                           scrape_interval_s=(SCRAPE_INTERVAL_S.get(engine, 0.25)
                                              if scrape_interval is None else scrape_interval),
                           scrape_timeout_s=scrape_timeout,
                           decision_log=decision_log, calibrate=calibrate,
                           predictor_state=predictor_state,
                           stall_after_s=stall_after, replica_bus=replica_bus,
                           replica_id=replica_id, replica_subject=replica_subject,
                           kv_endpoints=kv_endpoints, process=slot,
                           extra_listen=extra_listen, flow=flow,
                           options=GatewayOptions(max_body_bytes=max_body_bytes,
                                                  capture_prompts=capture_prompts,
                                                  observe_responses=observe_responses,
                                                  protocol=protocol))

    def ready(gw: Gateway) -> None:
        click.echo(f"cachepilot gateway ready: ext_proc :{gw.grpc_port}, "
                   f"admin http://{admin_host}:{gw.admin_port}", err=True)

    if standby and slot is None and not sys.stdin.readline():
        return  # the supervisor stopped without needing this spare
    gateway = Gateway(router, config)

    async def main() -> None:
        if kubernetes:
            from cachepilot.operator import OperatorOptions, run_operator

            gateway.add_task(run_operator(
                router, namespace=namespace, stop_flag=asyncio.Event(),
                options=OperatorOptions(lease_name=lease_name, epp_service=epp_service,
                                        objectives_group=objectives_group),
                kv_events=kv_sources, scraper=gateway.scraper,
                objectives=gateway.flow.objectives if gateway.flow is not None else None))
        await serve(gateway, ready)

    asyncio.run(main())


def _prompt_path(tokenizer: str | None, vllm_hash_seed: str | None,
                 chat_template: str | None, content_format: str,
                 lora_modules: tuple[str, ...], served_names: tuple[str, ...]
                 ) -> tuple[Tokenizer | None, VllmPrompts | None]:
    """The router's tokenizer (approximate blocks of real tokens) or, hashing as vLLM does,
    the engines' prompt path: tokenizer, chat template, LoRA adapters (docs/vllm.md)."""
    from cachepilot.datalayer.model_files import (
        ModelFilesError,
        load_prompts,
        parse_lora_modules,
        tokenizer_file,
    )

    if not tokenizer:
        return None, None
    try:
        if vllm_hash_seed is None:
            return load_tokenizer(str(tokenizer_file(tokenizer))), None
        prompts = load_prompts(tokenizer, chat_template=chat_template,
                               content_format=content_format,
                               lora_adapters=parse_lora_modules(lora_modules),
                               served_models=served_names)
    except ModelFilesError as exc:
        raise click.BadParameter(str(exc), param_hint="--tokenizer") from None
    except Exception as exc:  # tokenizers raises its own exception types
        raise click.BadParameter(f"cannot load {tokenizer}: {exc}",
                                 param_hint="--tokenizer") from None
    if prompts.template is None:
        logging.getLogger("cachepilot.gateway").warning(
            "no chat template for %s: chat requests are matched approximately", tokenizer)
    return None, prompts


@click.command("envoy-config")
@click.option("--listen-port", type=int, default=8080, show_default=True)
@click.option("--listen-address", default="0.0.0.0", show_default=True)
@click.option("--admin-port", type=int, default=9901, show_default=True)
@click.option("--ext-proc", default="127.0.0.1:9002", show_default=True, help="host:port")
@click.option("--ext-proc-processes", type=click.IntRange(1, 64), default=1, show_default=True,
              help="The gateway runs --processes N: routing streams go to the processes' own "
                   "ports (--ext-proc's + 1 … + N); each request is observed by the process "
                   "that routed it.")
@click.option("--fail-open/--fail-closed", default=False, show_default=True)
@click.option("--fallback", default="", help="host:port,… for fail-open (round robin).")
@click.option("--observe-responses/--no-observe-responses", default=True, show_default=True,
              help="Stream response bodies through the gateway (measured TTFT, cached tokens).")
@click.option("--observe-until", type=click.Choice(["first-token", "end"]),
              default="first-token", show_default=True,
              help="first-token: the gateway closes a response's observing stream at its first "
                   "token, and Envoy's access log reports the end, with the usage a Lua filter "
                   "reads from the answer's last bytes. end: every response message goes to "
                   "the gateway (~40 µs of its CPU each: one per streamed token).")
@click.option("--access-log-flush-ms", type=click.IntRange(min=0), default=10,
              show_default=True,
              help="Envoy's access log sends the entries of this many ms together (a gRPC "
                   "message costs the gateway more than an entry); a request's outcome "
                   "(status, usage) reaches the gateway up to this much after its end. 0: "
                   "each entry at once.")
@click.option("--max-body-bytes", type=int, default=8 * 1024 * 1024, show_default=True)
@click.option("--worker-requests-per-connection", type=click.IntRange(min=0), default=0,
              show_default=True,
              help="Requests Envoy sends on one connection to a worker (0: no limit). 1 for "
                   "llama.cpp workers: llama-server closes the connection after each streamed "
                   "answer although it advertises keep-alive, and a request sent on it at "
                   "once gets a 503.")
@click.option("--format", "fmt", type=click.Choice(["yaml", "json"]), default="yaml")
@click.option("--output", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write the bootstrap here instead of stdout (an init container's).")
@click.option("--epp", is_flag=True,
              help="Envoy in front of an endpoint picker (any EPP, CachePilot's with "
                   "--protocol epp or auto) as the Gateway API Inference Extension's reference "
                   "gateway configures it: FULL_DUPLEX_STREAMED, envoy.lb metadata (docs/epp.md).")
@click.option("--workers", default="",
              help="With --epp: known workers ip:port,… (override-host cluster reading the "
                   "EPP's envoy.lb metadata); none: ORIGINAL_DST on the header.")
@click.option("--subset-from-header", is_flag=True,
              help="With --epp: a request header x-gateway-destination-endpoint-subset becomes "
                   "the subset hint (tests; a client can then restrict the endpoints).")
def envoy_config_cmd(listen_port: int, listen_address: str, admin_port: int, ext_proc: str,
                     ext_proc_processes: int,
                     fail_open: bool, fallback: str, observe_responses: bool,
                     observe_until: str, access_log_flush_ms: int,
                     max_body_bytes: int, worker_requests_per_connection: int, fmt: str,
                     epp: bool, workers: str, subset_from_header: bool,
                     output: str | None) -> None:
    """Print Envoy's bootstrap for CachePilot."""
    from cachepilot.deploy.envoy import EnvoyOptions, EppEnvoyOptions, render

    host, port = host_port(ext_proc, "--ext-proc")
    for addr in (x for x in fallback.split(",") if x):
        host_port(addr, "--fallback")
    known = tuple(x.strip() for x in workers.split(",") if x.strip())
    for addr in known:
        host_port(addr, "--workers")
    if (known or subset_from_header) and not epp:
        raise click.UsageError("--workers and --subset-from-header go with --epp")
    if epp:
        try:
            eopts = EppEnvoyOptions(listen_address=listen_address, listen_port=listen_port,
                                    admin_port=admin_port, epp_host=host, epp_port=port,
                                    fail_open=fail_open, workers=known,
                                    fallback_workers=tuple(x for x in fallback.split(",") if x),
                                    subset_from_header=subset_from_header)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
        _emit(render(eopts, fmt), output)
        return
    try:
        opts = EnvoyOptions(listen_address=listen_address, listen_port=listen_port,
                            admin_port=admin_port, ext_proc_host=host, ext_proc_port=port,
                            fail_open=fail_open,
                            fallback_workers=tuple(x for x in fallback.split(",") if x),
                            observe_responses=observe_responses, max_body_bytes=max_body_bytes,
                            observe_until_first_token=observe_until == "first-token",
                            access_log_flush_ms=access_log_flush_ms,
                            ext_proc_processes=ext_proc_processes,
                            worker_requests_per_connection=worker_requests_per_connection)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    _emit(render(opts, fmt), output)


def _emit(text: str, output: str | None) -> None:
    if output is None:
        sys.stdout.write(text)
    else:
        Path(output).write_text(text)
