"""Envoy + the gateway + N llama-server workers on loopback, as processes."""

from __future__ import annotations

import json
import logging
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachepilot.tooling.llamacpp.calibration import Calibration, calibrate, cost_args
from cachepilot.tooling.llamacpp.routers import RouterSpec, start_peer
from cachepilot.tooling.llamacpp.worker import (
    CPU_BUDGET,
    PROMPT_STATE_MIB,
    SLIDING_WINDOW,
    LlamaWorkerSpec,
    model_path,
    threads_per_worker,
)
from cachepilot.tooling.procs import LoopbackAddresses, Processes, fetch_decision, http_get
from cachepilot.tooling.stack import LocalStack, StackConfig, free_port

log = logging.getLogger("cachepilot.llamacpp")


@dataclass
class LlamaStack(LoopbackAddresses):
    """Envoy + the gateway + N llama-server workers on loopback, as processes.

    Envoy comes from :class:`LocalStack` (no simulated workers, no gateway of its own); the
    gateway is ``cachepilot gateway --engine llamacpp`` with the calibrated CPU cost model
    (``--cost``), llama.cpp's scrape timing and a decision log whose records the admin API
    serves at ``/decisions/{id}`` (the experiment reads predictions there). With ``peer``,
    a peer router (sglang-router, vllm-router) fronts the same workers instead of the
    gateway and Envoy, after the same start and warm-up."""

    workers: int = 2
    spec: LlamaWorkerSpec | None = None  # None: threads from the CPU budget, other defaults
    policy: str = "priced"
    port: int = 0  # Envoy's listener; 0: a free port
    block_size: int = 16
    max_tokens: int = 8  # typical completion length, for the cost model's queue terms
    # The gateway sizes each worker's directory from the engine itself (llama-server's
    # GET /props: slots and context per slot, one prompt chain per slot). An explicit
    # capacity only applies until that first scrape.
    capacity_blocks: int | None = None
    log_dir: str | None = None
    peer: RouterSpec | None = None
    # The gateway's --predictor-state: a study's phases share one, as one long-running
    # gateway would keep what it learned of these workers (None: each start from the prior).
    predictor_state: str | None = None
    scrape_interval_s: float | None = None  # None: the gateway's default for llama.cpp
    decision_log: bool = True  # False: the gateway keeps none (what one costs, measured)
    # Envoy's per-try wait for a worker's first byte. A CPU worker with a queue can take
    # minutes to start answering; 1800 s is both peer routers' request timeout, so every
    # router of a study gives up at the same point (the sim stack's 60 s would 504 them).
    first_byte_timeout_s: float = 1800.0
    model: Path | None = None
    processes: Processes = field(default_factory=lambda: Processes(Path()))
    worker_ports: list[int] = field(default_factory=list)
    envoy: LocalStack | None = None
    calibration: Calibration | None = None
    admin_port: int = 0
    gateway_port: int = 0
    peer_port: int = 0
    directory: dict[str, Any] = field(default_factory=dict)  # the gateway's, after start

    @property
    def url(self) -> str:
        if self.peer is not None:
            return f"http://127.0.0.1:{self.peer_port}"
        assert self.envoy is not None
        return self.envoy.url

    def start(self, timeout_s: float = 120.0) -> LlamaStack:
        self.log_dir = self.log_dir or tempfile.mkdtemp(prefix="cachepilot-llama-")
        Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        self.processes.log_dir = Path(self.log_dir)
        if self.spec is None:
            self.spec = LlamaWorkerSpec(threads=threads_per_worker(self.workers))
        if self.workers * self.spec.threads > CPU_BUDGET:
            log.warning("%d workers x %d threads oversubscribe %d cores", self.workers,
                        self.spec.threads, CPU_BUDGET)
        model = self.model = self.model or model_path()
        try:
            self.worker_ports = [free_port() for _ in range(self.workers)]
            for i, port in enumerate(self.worker_ports):
                self.processes.spawn(f"llama-{i}", self.spec.args(model, port))
            self.processes.wait_ready([f"http://{a}/health" for a in self.worker_addresses],
                                      timeout_s, poll_s=0.2)
            # Every worker gets the same cold warm-up; worker 0's numbers calibrate the gateway.
            cals = [calibrate(a) for a in self.worker_addresses]
            self.calibration = cals[0]
            if self.peer is not None:
                self._start_peer(self.peer, timeout_s)
                return self
            self._start_gateway(timeout_s)
            # Envoy joins this stack's processes: one stop, one watch.
            # llama-server closes a connection after each streamed answer: one request each.
            self.envoy = LocalStack(StackConfig(
                workers=0, start_gateway=False, port=self.port, log_dir=self.log_dir,
                first_byte_timeout_s=self.first_byte_timeout_s,
                envoy={"worker_requests_per_connection": 1}), processes=self.processes,
                gateway_port=self.gateway_port, admin_port=self.admin_port)
            self.envoy.start(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_gateway(self, timeout_s: float) -> None:
        assert self.spec is not None and self.calibration is not None
        self.gateway_port, self.admin_port = free_port(), free_port()
        self.processes.spawn("gateway", self.gateway_args())
        self.processes.wait_ready([f"{self.admin_url}/readyz"], timeout_s,
                                  gateway_admin_url=self.admin_url)
        self.directory = self._directory()

    def gateway_args(self) -> list[str]:
        """``cachepilot gateway`` for these workers: the calibrated CPU cost model and byte
        blocks, llama.cpp's scrape timing, a decision log; no directory capacity unless one
        was given (the gateway reads each worker's slots from its /props)."""
        assert self.calibration is not None and self.spec is not None
        cal = self.calibration
        capacity = ["--capacity-blocks", str(self.capacity_blocks)] if self.capacity_blocks \
            else []
        return [sys.executable, "-m", "cachepilot", "gateway", "--engine", "llamacpp",
                "--listen", f"127.0.0.1:{self.gateway_port}",
                "--admin-port", str(self.admin_port),
                "--workers", ",".join(self.worker_addresses), "--policy", self.policy,
                "--block-size", str(self.block_size),
                "--chars-per-token", f"{cal.chars_per_token:.3f}", *capacity,
                "--cost", cost_args(cal.cost_model(self.max_tokens)),
                "--llama-cache-ram", str(self.spec.cache_ram_mib),
                "--llama-prompt-mib", str(PROMPT_STATE_MIB),
                # Gemma 3's sliding window: shorter matches are reused from checkpoints only.
                "--llama-min-reuse", str(SLIDING_WINDOW), "--llama-ubatch", str(self.spec.batch),
                "--scrape-timeout", "5", "--stall-after", f"{self.stall_after_s():.0f}",
                *(["--decision-log", str(Path(self.log_dir or ".") / "decisions")]
                  if self.decision_log else []),
                *(["--predictor-state", self.predictor_state] if self.predictor_state else []),
                *(["--scrape-interval", f"{self.scrape_interval_s:g}"]
                  if self.scrape_interval_s is not None else [])]

    def stall_after_s(self) -> float:
        """How long a worker may go without any first byte before the gateway takes it out
        of routing. A one-thread CPU worker answers one request at a time, and a cold prompt
        that fills its slot takes ctx x prefill ms (~10-25 s here under load), so the
        gateway's 10 s default took busy, healthy workers out (seen in the peers study:
        12 times in one phase, hits lost, a request refused). Five full-slot requests at
        the measured speed, and at least 30 s: a hung worker is still caught."""
        assert self.spec is not None and self.calibration is not None
        cal = self.calibration
        one = (self.spec.ctx_per_slot * cal.prefill_ms_per_token
               + self.max_tokens * cal.decode_ms_per_token) / 1000.0
        return max(30.0, 5 * one)

    def _directory(self) -> dict[str, Any]:
        """The gateway's directory per worker once it has scraped them all (blocks held,
        capacity in blocks: slots x context per slot when it read the engine's /props)."""
        code, body = http_get(f"{self.admin_url}/pools", timeout=5.0)
        pools = json.loads(body) if code == 200 else []
        return pools[0]["directory"] if pools else {}

    def _start_peer(self, peer: RouterSpec, timeout_s: float) -> None:
        self.peer_port = start_peer(self.processes, peer, self.worker_addresses, timeout_s)

    def decision(self, decision_id: str, timeout_s: float = 10.0,
                 with_outcome: bool = False) -> dict[str, Any] | None:
        """The gateway's record of one decision (its prediction and, once the response has
        ended, the outcome it observed); None if it never appears."""
        return fetch_decision(self.admin_url, decision_id, timeout_s, with_outcome)

    def stop(self) -> None:
        self.processes.stop()  # Envoy's too
        self.envoy = None

    def __enter__(self) -> LlamaStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
