"""The live flow-control drill's traffic (tests/helpers/flow_drill.py, as
tests/gateway/test_flow_drill.py sends it) with flow control on and off: a steady tenant
alone, then with a flood at four times capacity, a critical band and a sheddable band,
through Envoy, the gateway and two one-slot simulated workers.

    python benchmarks/flow_drill.py
"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cachepilot.tooling.stack import LocalStack, StackConfig

from helpers.flow_drill import TTL_S, drill, p99


def main() -> None:
    for label, args in (("on", ("--flow", f"ttl_s={TTL_S:g}")),
                        ("off", ("--flow-control", "off"))):
        config = StackConfig(workers=2, worker_args=("--max-batch", "1"),
                             gateway_args=(*args, "--cost", "max_batch=1"))
        with LocalStack(config) as stack:
            alone, both = asyncio.run(drill(stack.url))
        by = {t: [r for r in both if r.tenant == t] for t in ("steady", "flood", "ops", "batch")}
        served = [r for r in by["steady"] if r.status == 200]
        print(f"flow control {label}: steady p99 alone {p99(alone):.3f} s, with the flood "
              f"{p99(served):.3f} s; longest flood wait "
              f"{max(r.seconds for r in by['flood']):.2f} s; "
              + "; ".join(f"{t} {dict(Counter((r.status, r.reason) for r in v))}"
                          for t, v in by.items()))


if __name__ == "__main__":
    main()
