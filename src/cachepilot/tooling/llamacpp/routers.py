"""The routers a real-worker study puts in front of the same llama-server workers: CachePilot's
gateway behind Envoy (any of its policies), or a peer router from PyPI started as its own
process (``pip install 'cachepilot[peers]'``: ``sglang-router``, ``vllm-router``).

Peers run with their own defaults: only the listen address, the workers, the policy, a free
metrics port (their default 29000 may be taken) and a quieter log level are passed. Their
``cache_aware`` defaults, from their ``--help`` (sglang-router 0.3.2 ``launch``,
vllm-router 0.1.17): ``--cache-threshold 0.3`` (route to the worker with the longest
matching prefix when it covers more than 30 % of the request's text, else to the worker
with the smallest tree), ``--balance-abs-threshold 64`` and ``--balance-rel-threshold 1.5``
(balance by load only when the busiest worker has 64 more requests in flight than the least
busy and 1.5x as many), tree eviction every 60 s (sglang) or 120 s (vllm).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from cachepilot.tooling.procs import Processes
from cachepilot.tooling.stack import free_port


class PeerRouterMissing(RuntimeError):
    """A peer router's launcher is not installed."""


@dataclass(frozen=True)
class RouterSpec:
    """One router of a study: ``kind`` is ``cachepilot`` (the gateway, ``policy`` one of its
    policies) or a peer (``sglang``/``vllm``, ``policy`` one of the peer's own)."""

    name: str
    kind: str
    policy: str

    @property
    def is_peer(self) -> bool:
        return self.kind != "cachepilot"

    def launcher(self) -> Path:
        """The peer's console script, installed beside this interpreter."""
        path = Path(sys.executable).parent / f"{self.kind}-router"
        if not path.exists():
            raise PeerRouterMissing(f"{path.name} is not installed: pip install "
                                    "'cachepilot[peers]'")
        return path

    def args(self, port: int, metrics_port: int, worker_urls: list[str]) -> list[str]:
        """The peer's command line (each takes ``--worker-urls URL...``; sglang-router's
        launcher wants the ``launch`` subcommand)."""
        sub = ["launch"] if self.kind == "sglang" else []
        quiet = "warn" if self.kind == "sglang" else "warning"  # their spellings differ
        return [str(self.launcher()), *sub, "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *worker_urls, "--policy", self.policy,
                "--prometheus-port", str(metrics_port), "--log-level", quiet]


ROUTERS: dict[str, RouterSpec] = {s.name: s for s in (
    RouterSpec("cachepilot", "cachepilot", "priced"),
    RouterSpec("round_robin", "cachepilot", "round_robin"),
    RouterSpec("sglang_cache_aware", "sglang", "cache_aware"),
    RouterSpec("sglang_power_of_two", "sglang", "power_of_two"),
    RouterSpec("vllm_cache_aware", "vllm", "cache_aware"),
    RouterSpec("vllm_power_of_two", "vllm", "power_of_two"),
)}


def start_peer(processes: Processes, peer: RouterSpec, worker_addresses: list[str],
               timeout_s: float) -> int:
    """The peer router as its own process in front of these workers; its port, once its
    health check has found them (``/readiness`` in sglang-router, ``/health`` in
    vllm-router). The same launch for llama.cpp and vLLM workers: both routers proxy
    OpenAI completions and chat; vllm-router's ``cache_aware`` tokenizes each request on
    every worker (vLLM's ``/tokenize``; llama-server's answers in another format, so there
    it has no prefix affinity: docs/real-model.md)."""
    port = free_port()
    urls = [f"http://{a}" for a in worker_addresses]
    processes.spawn(peer.name, peer.args(port, free_port(), urls))
    ready = "readiness" if peer.kind == "sglang" else "health"
    processes.wait_ready([f"http://127.0.0.1:{port}/{ready}"], timeout_s, poll_s=0.2)
    return port


def peers_installed(names: list[str]) -> str | None:
    """None when every named peer router can start, else why not."""
    try:
        for n in names:
            if ROUTERS[n].is_peer:
                ROUTERS[n].launcher()
    except PeerRouterMissing as exc:
        return str(exc)
    return None
