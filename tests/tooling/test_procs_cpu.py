"""CPU accounting of a stack's processes (the real-worker studies' router CPU): a launcher
that runs its server as a child is charged for the child, and a name filter picks whose."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from cachepilot.tooling.procs import Processes, process_stat, tree_cpu_seconds

from helpers.polling import until

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="no /proc")

# An idle parent whose child spins (for 10 s at most, should the test die first).
SPIN = "import time\nt = time.time()\nwhile time.time() - t < 10: pass"
LAUNCHER = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {SPIN!r}])"


def test_a_launchers_busy_child_is_charged_to_it(tmp_path: Path) -> None:
    procs = Processes(tmp_path)
    procs.spawn("router", [sys.executable, "-c", LAUNCHER])
    procs.spawn("idle", [sys.executable, "-c", "import time; time.sleep(60)"])
    router, child = procs.procs["router"].pid, None
    try:
        start = procs.cpu_seconds(lambda n: n == "router")
        used = until(lambda: max(0.0, procs.cpu_seconds(lambda n: n == "router") - start)
                     > 0.3, timeout=20.0, what="the child's CPU counted")
        assert used
        own = process_stat(router)
        assert own is not None and own[1] < 0.3  # the launcher itself hardly ran
        assert procs.cpu_seconds(lambda n: n == "idle") < 0.3  # the filter left it out
        child = next(pid for pid in map(int, (p.name for p in Path("/proc").iterdir()
                                                if p.name.isdigit()))
                     if (st := process_stat(pid)) is not None and st[0] == router)
    finally:
        procs.stop()
        if child is not None:
            os.kill(child, signal.SIGKILL)
    assert tree_cpu_seconds([router]) == 0.0  # gone: nothing to count
