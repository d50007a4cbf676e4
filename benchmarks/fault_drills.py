"""The fault drills of issue 11 (tests/gateway/test_fault_drills.py: real Envoy, gateway,
simulated workers, loopback), run once, with the figures each drill measured.
docs/failures.md quotes them.

    .venv/bin/python benchmarks/fault_drills.py      # ~2-3 min on 2 cores
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                          "tests/gateway/test_fault_drills.py"], cwd=ROOT, capture_output=True,
                         text=True)
    for m in re.finditer(r"\[drill (\S+)\] (.*)", res.stdout):
        print(f"{m.group(1):<28} {m.group(2)}")
    print(res.stdout.strip().splitlines()[-1])
    return res.returncode


if __name__ == "__main__":
    sys.exit(main())
