"""The default policy before and after a change, in the simulated peers study's deployments,
paired by seed: run it once on each source tree (the one on ``PYTHONPATH``), then compare.

    git worktree add /tmp/before <rev>
    PYTHONPATH=/tmp/before/src python benchmarks/sim_before_after.py --seeds 0-9 \
        --out /tmp/before.json
    PYTHONPATH=src python benchmarks/sim_before_after.py --seeds 0-9 --out /tmp/after.json \
        --against /tmp/before.json

Each run is the study's default-policy cell (``cachepilot.lab.peers.run_policy``: the
study's workload, deployment and seeds; the peers are not run). The comparison prints, per
workload, the after/before geometric mean of p50, p90 and p99 TTFT with a t interval on
the log ratios, and the hit rate's paired difference (``cachepilot.lab.stats``): the same
statistics as the study's cells, without a family adjustment (a handful of tests, each
reported).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.progress import track

from cachepilot.cli.study_options import parse_seeds
from cachepilot.lab.peers import DEFAULT, run_policy, workloads
from cachepilot.lab.stats import paired_difference, paired_ratio
from cachepilot.sim.workloads import generate

KEPT = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "token_hit_rate")
TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"


def run(names: list[str], seeds: tuple[int, ...], trace: Path | None) -> dict[str, Any]:
    deployments = workloads(trace, slots=True)
    out: dict[str, Any] = {}
    for name, seed in track([(n, s) for n in names for s in seeds], description="cells"):
        spec, cfg = deployments[name]
        s = run_policy(cfg, generate(spec, seed), DEFAULT)
        out[f"{name}/{seed}"] = {k: s[k] for k in KEPT}
    return out


def compare(after: dict[str, Any], before: dict[str, Any]) -> list[str]:
    keys = [k for k in after if k in before]
    lines = ["| workload | seeds | p50 | p90 | p99 | hit rate (points) |",
             "|---|---|---|---|---|---|"]
    for name in dict.fromkeys(k.split("/")[0] for k in keys):
        ks = [k for k in keys if k.startswith(name + "/")]
        cells = []
        for m in KEPT[:3]:
            r = paired_ratio([after[k][m] for k in ks], [before[k][m] for k in ks])
            cells.append(f"{r['rel']:+.1%} [{r['rel_lo']:+.1%}, {r['rel_hi']:+.1%}]"
                         + (" **" if r["significant"] else ""))
        d = paired_difference([after[k][KEPT[3]] for k in ks], [before[k][KEPT[3]] for k in ks])
        cells.append(f"{100 * d['mean']:+.2f} [{100 * d['lo']:+.2f}, {100 * d['hi']:+.2f}]"
                     + (" **" if d["significant"] else ""))
        lines.append(f"| {name} | {len(ks)} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("after ÷ before (TTFT) and after − before (hit rate), 95 % intervals; "
                 "** = p < 0.05 (unadjusted)")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0-9", help="A-B, a list A,B,C or a count")
    ap.add_argument("--workloads", default="llama_shared,llama_hotspot",
                    help="comma-separated names of the peers study's workloads")
    ap.add_argument("--out", type=Path, required=True, help="this tree's results (JSON)")
    ap.add_argument("--against", type=Path, help="the other tree's results, to compare")
    args = ap.parse_args()
    names = [n for n in args.workloads.split(",") if n]
    trace = TRACE if TRACE.exists() else None
    known = workloads(trace, slots=True)
    unknown = [n for n in names if n not in known]
    if unknown:
        print(f"unknown workload(s) {', '.join(unknown)}: one of {', '.join(known)}",
              file=sys.stderr)
        return 2
    try:
        seeds = parse_seeds(args.seeds)
    except ValueError as exc:
        print(f"bad --seeds: {exc}", file=sys.stderr)
        return 2
    results = run(names, seeds, trace)
    args.out.write_text(json.dumps(results, indent=1))
    if args.against is not None:
        print("\n".join(compare(results, json.loads(args.against.read_text()))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
