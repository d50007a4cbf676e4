"""What parsing one worker's /metrics scrape costs the gateway: prometheus-client's parser on
the whole text (as the gateway did) against the gateway's parse (only the families it reads
reach the parser), interleaved, on a real vLLM 0.32 scrape (tests/data/vllm_metrics.txt,
614 lines) unless ``--file`` names another. The gateway scrapes every worker every second or
less, on the CPUs a CPU engine computes on.

    python benchmarks/metrics_parse.py [--file metrics.txt] [--engine vllm] [--repeats 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from cachepilot.datalayer.engine_metrics import parse_metrics

FIXTURE = Path(__file__).parents[1] / "tests" / "data" / "vllm_metrics.txt"


def whole(text: str) -> None:
    for family in text_string_to_metric_families(text):
        for _ in family.samples:
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", type=Path, default=FIXTURE)
    ap.add_argument("--engine", default="vllm")
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    text = args.file.read_text()
    times: dict[str, list[float]] = {"whole text": [], "gateway": []}
    for _ in range(args.repeats):  # interleaved: machine noise lands on both alike
        t0 = time.perf_counter()
        whole(text)
        t1 = time.perf_counter()
        parse_metrics(text, args.engine, 0.0)
        t2 = time.perf_counter()
        times["whole text"].append(t1 - t0)
        times["gateway"].append(t2 - t1)
    base = statistics.median(times["whole text"])
    print(f"{args.file} ({len(text.splitlines())} lines, {len(text) / 1024:.0f} KB), "
          f"{args.repeats} interleaved repeats\n")
    print("| parse | median ms | ÷ whole text |\n|---|---:|---:|")
    for name, xs in times.items():
        print(f"| {name} | {statistics.median(xs) * 1000:.2f} | "
              f"{statistics.median(xs) / base:.2f} |")


if __name__ == "__main__":
    main()
