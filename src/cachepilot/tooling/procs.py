"""Child processes of a local stack: spawn with a log file each, wait until their health URLs
answer, stop them all. Shared by the simulated stack (:mod:`.stack`) and the llama.cpp stack
(:mod:`.llamacpp`)."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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


def wait_http_ok(urls: list[str], timeout_s: float = 60.0, hint: str = "") -> None:
    """Until every URL answers 200, in order; TimeoutError naming the first that did not
    (``hint``, e.g. where the logs are, is appended)."""
    deadline = time.time() + timeout_s
    for url in urls:
        while http_status(url, timeout=0.5) != 200:
            if time.time() > deadline:
                raise TimeoutError(f"not ready: {url}{hint}")
            time.sleep(0.2)


def fetch_decision(admin_url: str, decision_id: str, timeout_s: float = 10.0,
                   with_outcome: bool = False) -> dict[str, Any] | None:
    """A gateway's record of one decision from its admin API (its prediction and, once the
    response has ended, the outcome it observed); None if it never appears."""
    deadline = time.monotonic() + timeout_s
    while True:
        code, body = http_get(f"{admin_url}/decisions/{decision_id}", timeout=2.0)
        rec = json.loads(body)["record"] if code == 200 else None
        if rec is not None and (not with_outcome or rec.get("outcome")):
            return rec
        if time.monotonic() > deadline:
            return None
        time.sleep(0.2)  # the decision log commits in batches


def gateway_scraped_all(admin_url: str) -> bool:
    """True once the gateway has scraped every worker at least once: before that it routes
    without load figures, which makes a first burst of requests land unevenly."""
    try:
        code, body = http_get(f"{admin_url}/workers")
    except OSError:
        return False
    return code == 200 and all(w["scraped_at"] for w in json.loads(body))


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def process_stat(pid: int | str) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of a live process, from /proc; None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # The command name may hold spaces and parentheses: the fields follow its last ")".
            fields = f.read().rpartition(b")")[2].split()
    except OSError:
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) * _TICK_S


def tree_cpu_seconds(pids: list[int]) -> float:
    """CPU seconds (user + system) used so far by these processes and their live descendants
    (a launcher script may run its server as a child): 0 on a system without /proc."""
    stats = {int(e): st for e in (os.listdir("/proc") if os.path.isdir("/proc") else ())
             if e.isdigit() and (st := process_stat(e)) is not None}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo, seen = 0.0, list(pids), set()
    while todo:
        pid = todo.pop()
        if pid in seen or pid not in stats:
            continue
        seen.add(pid)
        total += stats[pid][1]
        todo += children.get(pid, [])
    return total


@dataclass
class Processes:
    log_dir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    args: dict[str, list[str]] = field(default_factory=dict)  # to restart them
    # Warm spares: started with a standby flag, they load everything and wait for a line on
    # stdin before serving, so a restart costs no interpreter start and imports (~1-3 s here).
    spares: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    spare_flags: dict[str, str] = field(default_factory=dict)

    def spawn(self, name: str, args: list[str], spare_flag: str | None = None) -> None:
        """Start ``name``; its output goes to ``<name>.log`` (appended on a restart) and its
        pid to ``<name>.pid`` in ``log_dir``. With ``spare_flag``, a warm spare waits too."""
        self.args[name] = args
        self.procs[name] = proc = self._popen(name, args, subprocess.DEVNULL)
        (self.log_dir / f"{name}.pid").write_text(str(proc.pid))
        if spare_flag:
            self.spare_flags[name] = spare_flag
            self._start_spare(name)

    def _popen(self, name: str, args: list[str], stdin: int) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - lives with the process
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=stdin)

    def _start_spare(self, name: str) -> None:
        self.spares[name] = self._popen(name, [*self.args[name], self.spare_flags[name]],
                                        subprocess.PIPE)

    def respawn(self, name: str) -> None:
        """Restart ``name``: promote its warm spare if it has a live one (and start the next
        spare), else start it afresh."""
        spare = self.spares.pop(name, None)
        if spare is None or spare.poll() is not None or spare.stdin is None:
            self.spawn(name, self.args[name], self.spare_flags.get(name))
            return
        spare.stdin.write(b"go\n")
        spare.stdin.flush()
        self.procs[name] = spare
        (self.log_dir / f"{name}.pid").write_text(str(spare.pid))
        self._start_spare(name)

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

    def cpu_seconds(self, names: Callable[[str], bool] = lambda _: True) -> float:
        """CPU seconds the live processes whose names pass ``names`` (and their children)
        have used so far; a difference of two calls is what they used in between."""
        return tree_cpu_seconds([p.pid for n, p in self.procs.items() if names(n)])

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.kill()
        proc.wait()

    def stop(self) -> None:
        for spare in self.spares.values():  # end of stdin: a spare exits without serving
            if spare.stdin is not None:
                spare.stdin.close()
        for proc in (*self.procs.values(), *self.spares.values()):
            if proc.poll() is None:
                proc.terminate()
        for proc in (*self.procs.values(), *self.spares.values()):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        self.spares.clear()


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


@dataclass(frozen=True)
class RestartPolicy:
    """How ``supervise`` restarts a component that exited: after ``backoff_s``, doubled on each
    restart up to ``max_backoff_s``; it gives up when one component needs more than
    ``max_restarts`` restarts within ``window_s``."""

    backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    max_restarts: int = 5
    window_s: float = 60.0


def _how(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with {code}"


def supervise(processes: Processes, policy: RestartPolicy = RestartPolicy(),
              say: Callable[[str], None] = print, poll_s: float = 0.05) -> int:
    """Keep every process running until Ctrl-C (0) or until one keeps dying (1): a component
    that exits is restarted with backoff, each restart said by name. On return the caller
    stops the rest."""
    restarts: dict[str, list[float]] = {}
    due: dict[str, float] = {}  # name → when to restart it
    try:
        while True:
            now = time.monotonic()
            for name, proc in list(processes.procs.items()):
                code = proc.poll()
                if code is None or name in due:
                    continue
                recent = [t for t in restarts.get(name, []) if now - t < policy.window_s]
                if len(recent) >= policy.max_restarts:
                    say(f"{name} {_how(code)}; giving up after {len(recent)} restarts in "
                        f"{policy.window_s:g}s (logs: {processes.log_dir / f'{name}.log'})")
                    return 1
                delay = min(policy.max_backoff_s, policy.backoff_s * 2 ** len(recent))
                restarts[name] = [*recent, now]
                due[name] = now + delay
                say(f"{name} {_how(code)}; restarting in {delay:.2g}s "
                    f"(restart {len(recent) + 1} of {policy.max_restarts} in "
                    f"{policy.window_s:g}s)")
            for name, at in list(due.items()):
                if now >= at:
                    del due[name]
                    processes.respawn(name)
            time.sleep(poll_s)
    except KeyboardInterrupt:
        return 0
