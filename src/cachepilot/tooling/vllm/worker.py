"""Real vLLM workers on the CPU: the ``vllm serve`` command and environment of one worker, and
a launcher for N of them (``python -m cachepilot.tooling.vllm.worker --workers 2``).

Every worker runs with prefix caching hashed by ``sha256_cbor`` (reproducible outside vLLM),
KV events on ZMQ with a replay endpoint, one KV group (``--disable-hybrid-kv-cache-manager``:
Gemma 3's sliding-window groups would otherwise publish every block too) and the same
``PYTHONHASHSEED``, the seed of vLLM's NONE_HASH, which the gateway must be told
(:attr:`VllmWorkerSpec.hash_seed`). The flags and environment are the ones measured to work
here (shared FACTS, "vLLM on CPU"): block size 32 (CPU refuses 16), ``--enforce-eager``
(start-up ~55 s instead of ~165 s), 1 GiB of KV cache each, one OpenMP thread bound to a
core of its own per worker, and caches and IPC sockets in a folder of ours.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from cachepilot.tooling.vllm.model import SERVED_NAME

HASH_SEED = "0"
# Gemma 3's chat template: the model folder converted from the GGUF has none (vLLM then
# refuses chat requests), so the workers get it with --chat-template and the gateway renders
# the same file (docs/vllm.md).
CHAT_TEMPLATE = Path(__file__).with_name("gemma3_chat_template.jinja")


@dataclass(frozen=True)
class VllmWorkerSpec:
    block_size: int = 32
    max_model_len: int = 4096
    kv_cache_gib: int = 1
    # vLLM's own default for an API server on the CPU (engine/arg_utils.py,
    # _set_default_max_num_seqs_and_batched_tokens_args), said explicitly because vLLM does
    # not export it and the gateway must be told (--cost max_batch) to see a full batch.
    max_num_seqs: int = 128
    hash_seed: str = HASH_SEED
    enforce_eager: bool = True
    served_name: str = SERVED_NAME
    chat_template: Path | None = CHAT_TEMPLATE
    # LoRA adapters as (name, path): --enable-lora --lora-modules name=path (vLLM on the CPU
    # serves them: PunicaWrapperCPU). The path string is part of every block hash.
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_lora_rank: int = 8
    extra_args: tuple[str, ...] = ()
    extra_env: tuple[tuple[str, str], ...] = ()

    def args(self, venv: Path, model: Path, port: int, events_port: int,
             host: str = "127.0.0.1") -> list[str]:
        """``vllm serve`` on ``host:port``, KV events published on ``host:events_port`` and
        replayed on ``host:events_port + 1``.

        vLLM's publisher binds an endpoint with ``*`` or ``::`` in it and *connects* to any
        other, so the PUB endpoint is the IPv4-mapped form ``tcp://[::ffff:HOST]:P``: it binds
        ``HOST`` only (not every interface, as ``tcp://*:P`` would), and workers on distinct
        loopback addresses (127.0.0.2, 127.0.0.3, …) can all publish on the same port, which
        is what the gateway's ``--kv-events-port`` expects (every worker on its own host)."""
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://[::ffff:{host}]:{events_port}",
                  "replay_endpoint": f"tcp://{host}:{events_port + 1}", "topic": "kv-events"}
        return [str(venv.absolute() / "bin" / "vllm"), "serve", str(model),
                "--host", host, "--port", str(port),
                "--served-model-name", self.served_name,
                "--max-model-len", str(self.max_model_len), "--dtype", "bfloat16",
                "--block-size", str(self.block_size), "--max-num-seqs", str(self.max_num_seqs),
                "--enable-prefix-caching", "--prefix-caching-hash-algo", "sha256_cbor",
                "--enable-prompt-tokens-details", "--disable-hybrid-kv-cache-manager",
                *(["--enforce-eager"] if self.enforce_eager else []),
                *(["--chat-template", str(self.chat_template)] if self.chat_template else []),
                *self.lora_args(),
                "--kv-events-config", json.dumps(events), *self.extra_args]

    def lora_args(self) -> list[str]:
        if not self.lora_modules:
            return []
        return ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank),
                "--max-loras", str(len(self.lora_modules)),
                "--lora-modules", *(f"{name}={path}" for name, path in self.lora_modules)]

    def env_vars(self, index: int, state_dir: Path, tmp: Path) -> dict[str, str]:
        """What a worker's environment adds to ours. ``tmp`` holds vLLM's IPC sockets: a
        short path (a socket path has 107 bytes)."""
        cache = state_dir / f"worker-{index}"
        cache.mkdir(parents=True, exist_ok=True)
        cores = os.cpu_count() or 1
        return {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
                "VLLM_CPU_OMP_THREADS_BIND": str(index % cores),
                "PYTHONHASHSEED": self.hash_seed, "VLLM_CACHE_ROOT": str(cache),
                "TMPDIR": str(tmp), "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1", **dict(self.extra_env)}

    def env(self, index: int, state_dir: Path, tmp: Path) -> dict[str, str]:
        return {**os.environ, **self.env_vars(index, state_dir, tmp)}

    def command(self, venv: Path, model: Path, index: int, host: str, port: int,
                events_port: int, state_dir: Path, tmp: Path) -> list[str]:
        """One command line with the environment in front (``env K=V … vllm serve …``), for
        a supervisor that starts commands, not environments (``tooling.procs``)."""
        return ["env", *(f"{k}={v}" for k, v in self.env_vars(index, state_dir, tmp).items()),
                *self.args(venv, model, port, events_port, host)]


@dataclass
class VllmWorker:
    index: int
    port: int
    events_port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    tmp: Path
    host: str = "127.0.0.1"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def events_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.events_port + 1}"


@dataclass
class VllmWorkers:
    """N vLLM workers as child processes; :meth:`stop` ends exactly those (process groups)."""

    venv: Path
    model: Path
    spec: VllmWorkerSpec = field(default_factory=VllmWorkerSpec)
    state_dir: Path = Path("runs/vllm")
    workers: list[VllmWorker] = field(default_factory=list)

    def start(self, n: int, base_port: int = 8100, base_events_port: int = 5557,
              hosts: list[str] | None = None) -> None:
        """Worker i on ``base_port + i`` with events on ``base_events_port + 2i`` (all on
        127.0.0.1), or, with ``hosts``, on ``hosts[i]`` with the same ports for all."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            host = hosts[i] if hosts else "127.0.0.1"
            port, events_port = ((base_port, base_events_port) if hosts else
                                 (base_port + i, base_events_port + 2 * i))
            tmp = Path(tempfile.mkdtemp(prefix=f"cpvllm{i}-"))
            self.workers.append(VllmWorker(i, port, events_port, self._spawn(i, host, port,
                                                                             events_port, tmp),
                                           self.state_dir / f"worker-{i}.log", tmp, host))

    def _spawn(self, i: int, host: str, port: int, events_port: int,
               tmp: Path) -> subprocess.Popen[bytes]:
        with (self.state_dir / f"worker-{i}.log").open("ab") as log:
            return subprocess.Popen(self.spec.args(self.venv, self.model, port, events_port,
                                                   host),
                                    env=self.spec.env(i, self.state_dir.absolute(), tmp),
                                    stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def kill(self, index: int) -> None:
        """SIGKILL worker ``index``'s whole process group (API server and engine core): a
        crash, with no chance to publish or clean up anything."""
        w = self.workers[index]
        if w.proc.poll() is None:
            os.killpg(w.proc.pid, signal.SIGKILL)
        w.proc.wait()

    def respawn(self, index: int) -> None:
        """Start worker ``index`` again at the same address and ports (a new process with
        an empty cache); :meth:`wait_ready` waits for it."""
        w = self.workers[index]
        if w.proc.poll() is None:
            raise RuntimeError(f"vLLM worker {index} is still running")
        w.proc = self._spawn(index, w.host, w.port, w.events_port, w.tmp)

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Seconds until every worker answers /health; raises with its log's tail if one
        exits or the time runs out."""
        t0 = time.monotonic()
        pending = list(self.workers)
        while pending:
            for w in list(pending):
                if w.proc.poll() is not None:
                    raise RuntimeError(f"vLLM worker {w.index} exited ({w.proc.returncode}):\n"
                                       + self.log_tail(w))
                try:
                    with urllib.request.urlopen(f"http://{w.address}/health", timeout=2) as r:
                        if r.status == 200:
                            pending.remove(w)
                except OSError:
                    pass
            if pending and time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"vLLM worker not ready in {timeout_s:.0f} s:\n"
                                   + self.log_tail(pending[0]))
            if pending:
                time.sleep(1.0)
        return time.monotonic() - t0

    @staticmethod
    def log_tail(w: VllmWorker, n: int = 4000) -> str:
        try:
            return w.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 20.0) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                os.killpg(w.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for w in self.workers:
            try:
                w.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(w.proc.pid, signal.SIGKILL)
                w.proc.wait()
            shutil.rmtree(w.tmp, ignore_errors=True)
        self.workers.clear()

    def __enter__(self) -> VllmWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    from cachepilot.tooling.vllm.model import prepare

    ap = argparse.ArgumentParser(description="run N vLLM workers until Ctrl-C")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--venv", type=Path, default=Path(".venv-vllm"))
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--events-port", type=int, default=5557)
    args = ap.parse_args(argv)
    model = prepare(args.venv)
    with VllmWorkers(args.venv, model) as ws:
        ws.start(args.workers, args.port, args.events_port)
        print(f"ready in {ws.wait_ready():.0f} s", flush=True)
        for w in ws.workers:
            print(f"worker {w.index}: http://{w.address}  events {w.events_endpoint}  "
                  f"replay {w.replay_endpoint}  PYTHONHASHSEED={ws.spec.hash_seed}", flush=True)
        try:
            while all(w.proc.poll() is None for w in ws.workers):
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
