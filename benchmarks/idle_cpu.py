"""What the local stack costs while no request comes: Envoy's and the gateway's CPU over an
idle stretch, for two values of one of Envoy's options, alternating on fresh stacks. A
timer that fires whatever the load (Envoy's access log flush, every ``access_log_flush_ms``
per worker thread) shows here, and in a study at a low request rate it is part of the
router's CPU per request.

    python benchmarks/idle_cpu.py --envoy access_log_flush_ms=0,10
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from cachepilot.tooling.stack import LocalStack, StackConfig

sys.path.insert(0, str(Path(__file__).parent))
from processes_hit_rate import envoy_arms


def _cpu(stack: LocalStack) -> tuple[float, float]:
    """CPU seconds Envoy and the gateway have used so far."""
    procs = stack.processes
    return (procs.cpu_seconds(lambda n: n == "envoy"),
            procs.cpu_seconds(lambda n: n == "gateway"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--envoy", default="access_log_flush_ms=0,10", metavar="NAME=A,B")
    ap.add_argument("--seconds", type=float, default=20.0, help="idle stretch per stack")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    arms = envoy_arms(args.envoy, 1)
    label = args.envoy.split("=", 1)[0]
    print(f"| round | {label} | Envoy CPU ms/s | gateway CPU ms/s |\n|---:|---:|---:|---:|")
    for r in range(args.rounds):
        for name, _, envoy in (arms if r % 2 == 0 else arms[::-1]):
            with LocalStack(StackConfig(workers=2, envoy=envoy)) as stack:
                time.sleep(3.0)  # started, scraped, settled
                e0, g0 = _cpu(stack)
                time.sleep(args.seconds)
                e1, g1 = _cpu(stack)
            print(f"| {r + 1} | {name} | {(e1 - e0) * 1000 / args.seconds:.1f} | "
                  f"{(g1 - g0) * 1000 / args.seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
