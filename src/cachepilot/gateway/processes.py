"""``cachepilot gateway --processes N``: N gateway processes that route as one, so a node's
cores add up (one Python process routes on one core: the GIL, and grpc.aio's one loop).

The command becomes a supervisor: it starts N copies of itself, each told its index by the
environment (:data:`INDEX_ENV`, with the group name every copy shares), and restarts one
that dies. Process *i*:

* serves ext_proc on the ``--listen`` port, shared by all N (SO_REUSEPORT, grpc's
  default: the kernel spreads connections, so any client reaching that one port reaches
  every process), and on a port of its own, ``--listen``'s + 1 + *i*. Our Envoy config
  (``envoy-config --ext-proc-processes N``) uses the own ports: routing streams round robin
  over them, and each request's observing stream goes to the process that routed it, named
  by its decision id (``p<i>.…``, :func:`id_prefix`; on the shared port it could reach
  another);
* serves its admin API on ``--admin-port`` + *i*, and writes its own decision log
  (``<path>-p<i>`` for *i* > 0: one writer per LMDB log);
* shares placements and in-flight bookings with the others, over local sockets
  (:mod:`cachepilot.gateway.local_peers`), or over ``--replica-bus`` when one is given
  (each process is then a replica of its own).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from cachepilot.gateway.protocol import PROCESS_ID_PREFIX

log = logging.getLogger("cachepilot.gateway")

INDEX_ENV = "CACHEPILOT_PROCESS_INDEX"
GROUP_ENV = "CACHEPILOT_PROCESS_GROUP"


@dataclass(frozen=True, slots=True)
class ProcessSlot:
    """Which of the gateway's processes this one is."""

    index: int
    count: int
    group: str

    def own_port(self, base: int) -> int:
        """This process's own ext_proc port (0 stays 0: any free port)."""
        return base + 1 + self.index if base else 0

    def admin_port(self, base: int) -> int:
        return base + self.index if base else 0

    def own_path(self, path: str | None) -> str | None:
        """This process's own file or directory (decision log, predictor state): the given
        path for process 0, ``<path>-p<i>`` for the others."""
        return path if path is None or self.index == 0 else f"{path}-p{self.index}"


def id_prefix(index: int) -> str:
    """Decision ids of process ``index``: ``p<index>.<random>``, what Envoy's per-process
    routes match to send a request's observing stream to the process that routed it."""
    return f"{PROCESS_ID_PREFIX}{index}.{os.urandom(3).hex()}"


def current_slot(count: int) -> ProcessSlot | None:
    """This process's slot when the supervisor started it (None: not one of N)."""
    index = os.environ.get(INDEX_ENV)
    if count <= 1 or index is None:
        return None
    return ProcessSlot(int(index), count, os.environ.get(GROUP_ENV, ""))


def supervise(argv: Sequence[str], count: int, *, restart_after_s: float = 1.0,
              grace_s: float = 10.0) -> int:
    """Run ``argv`` ``count`` times (each told its index) until SIGTERM or SIGINT, restarting
    a process that exits on its own; returns the exit status."""
    group = f"{os.getpid()}-{os.urandom(3).hex()}"

    def start(i: int) -> subprocess.Popen[bytes]:
        env = {**os.environ, INDEX_ENV: str(i), GROUP_ENV: group}
        return subprocess.Popen(list(argv), env=env)

    children = [start(i) for i in range(count)]
    started = [time.monotonic()] * count
    quick_exits = 0  # in a row: a process that cannot start (a port taken) stops them all
    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for c in children:
            if c.poll() is None:
                c.send_signal(signum)

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stopping:
            time.sleep(0.2)
            for i, c in enumerate(children):
                if c.poll() is None or stopping:
                    continue
                quick_exits = quick_exits + 1 if time.monotonic() - started[i] < 5.0 else 0
                if quick_exits >= 3:
                    log.error("gateway process %d keeps exiting (%s); stopping", i,
                              c.returncode)
                    stop(signal.SIGTERM, None)
                    break
                log.warning("gateway process %d exited (%s); restarting", i, c.returncode)
                time.sleep(restart_after_s)
                children[i], started[i] = start(i), time.monotonic()
        deadline = time.monotonic() + grace_s
        for c in children:
            try:
                c.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.kill()
                c.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 1 if quick_exits >= 3 else max((c.returncode or 0) for c in children)


def child_argv() -> list[str]:
    """How this command runs itself again: the same interpreter and arguments."""
    return [sys.executable, "-m", "cachepilot", *sys.argv[1:]]
