"""Child processes of a local stack: spawn with a log file each, wait until their health URLs
answer, stop them all. Shared by the simulated stack (:mod:`.stack`) and the llama.cpp stack
(:mod:`.llamacpp`)."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


def http_get(url: str, timeout: float = 1.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def http_status(url: str, timeout: float = 1.0) -> int:
    """The status code, or 0 if nothing answered."""
    try:
        return http_get(url, timeout=timeout)[0]
    except OSError:
        return 0


def gateway_scraped_all(admin_url: str) -> bool:
    """True once the gateway has scraped every worker at least once: before that it routes
    without load figures, which makes a first burst of requests land unevenly."""
    try:
        code, body = http_get(f"{admin_url}/workers")
    except OSError:
        return False
    return code == 200 and all(w["scraped_at"] for w in json.loads(body))


@dataclass
class Processes:
    log_dir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def spawn(self, name: str, args: list[str]) -> None:
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - lives with the process
        self.procs[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)

    def raise_if_exited(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail}")

    def wait_ready(self, urls: list[str], timeout_s: float, *,
                   gateway_admin_url: str | None = None, poll_s: float = 0.1) -> None:
        """Until every URL answers 200 and, given its admin URL, the gateway has scraped every
        worker; fails fast if a process exits."""
        deadline = time.monotonic() + timeout_s
        pending = list(urls)
        while True:
            self.raise_if_exited()
            pending = [u for u in pending if http_status(u, timeout=2.0) != 200]
            if not pending and (gateway_admin_url is None
                                or gateway_scraped_all(gateway_admin_url)):
                return
            if time.monotonic() > deadline:
                what = pending or [f"the gateway at {gateway_admin_url} to scrape every worker"]
                raise TimeoutError(f"not ready after {timeout_s}s: {what} "
                                   f"(logs: {self.log_dir})")
            time.sleep(poll_s)

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.kill()
        proc.wait()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()


class LoopbackAddresses:
    """Addresses of a stack whose processes listen on 127.0.0.1 (``admin_port`` is the
    gateway's admin API, ``worker_ports`` the model servers')."""

    admin_port: int
    worker_ports: list[int]

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def worker_addresses(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.worker_ports]


def serve_until_interrupted(processes: Processes) -> str:
    """Block while every process runs; return why it stopped (a component exited, or
    KeyboardInterrupt: Ctrl-C, or SIGTERM where the caller maps it to SIGINT's handler)."""
    try:
        while all(p.poll() is None for p in processes.procs.values()):
            time.sleep(0.5)
        return "a component exited; see the logs"
    except KeyboardInterrupt:
        return "interrupted"
