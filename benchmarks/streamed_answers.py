"""What observing a streamed answer costs, through a real Envoy: until its first token (the
default) against all of it.

Two local stacks (Envoy, the gateway, two simulated workers each), one per way of observing:

* ``first-token``: the default. The gateway closes the observing stream at the first token;
  Envoy's access log brings the end, with the usage its Lua filter read from the answer's
  last bytes (``cachepilot.deploy.envoy.usage``);
* ``whole``: ``observe_until_first_token`` off, the observing stream carries every body
  message of the answer (one per streamed event, as they arrive) to the end.

For each answer length (``--tokens``), each stack serves ``--requests`` streamed chat
requests (8 KB prompts, ``--concurrency`` in flight), the stacks in turn, ``--rounds``
times with the order alternating. Reported per stack and length: the gateway's and Envoy's
CPU per request (from /proc, around the stack's own batch), the body messages Envoy sent the
observing stream per request (its ``stream_msgs_sent`` statistic, less the two headers
messages), and the answers' median end-to-end time; then first-token over whole, the
geometric mean of the per-round ratios with its 95 % interval (t on the log ratios,
``cachepilot.lab.stats.paired_ratio``).

    python benchmarks/streamed_answers.py                          # 1, 16, 128, 512 tokens
    python benchmarks/streamed_answers.py --out docs/results/streamed-answers  # + report, PNG
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from cachepilot.lab.stats import paired_ratio
from cachepilot.tooling.stack import LocalStack, StackConfig

MODEL = "sim-llama-8b"
WAYS = {"first-token": {}, "whole": {"observe_until_first_token": False}}
OBSERVE_SENT = "http.cachepilot.ext_proc.observe.stream_msgs_sent"
OBSERVE_STARTED = "http.cachepilot.ext_proc.observe.streams_started"


def envoy_stats(stack: LocalStack) -> dict[str, int]:
    text = httpx.get(f"http://127.0.0.1:{stack.envoy_admin_port}/stats", timeout=5).text
    pairs = (line.split(": ", 1) for line in text.splitlines() if ": " in line)
    return {k: int(v) for k, v in pairs if v.isdigit()}


async def batch(url: str, n: int, concurrency: int, tokens: int, tag: str) -> list[float]:
    """``n`` streamed chat requests, ``concurrency`` at a time; each one's seconds."""
    sem = asyncio.Semaphore(concurrency)
    doc = ("Answer from the manual. " * 360)[:8192]  # 8 KB, shared: hits after the first

    async def one(session: aiohttp.ClientSession, i: int) -> float:
        body = {"model": MODEL, "max_tokens": tokens, "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "system", "content": doc},
                             {"role": "user", "content": f"{tag} question {i}"}]}
        async with sem:
            t0 = time.perf_counter()
            async with session.post(url + "/v1/chat/completions", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {(await r.read())[:200]!r}")
                async for _ in r.content.iter_any():
                    pass
            return time.perf_counter() - t0

    async with aiohttp.ClientSession() as session:
        return list(await asyncio.gather(*(one(session, i) for i in range(n))))


def measure(stack: LocalStack, args: argparse.Namespace, tokens: int, tag: str
            ) -> dict[str, float]:
    def cpu(name: str) -> float:
        return stack.processes.cpu_seconds(lambda n: n == name)

    before = envoy_stats(stack)
    gw, env = cpu("gateway"), cpu("envoy")
    times = asyncio.run(batch(stack.url, args.requests, args.concurrency, tokens, tag))
    gw, env = cpu("gateway") - gw, cpu("envoy") - env
    time.sleep(0.3)  # the last access log entries and observing streams settle
    after = envoy_stats(stack)
    streams = after.get(OBSERVE_STARTED, 0) - before.get(OBSERVE_STARTED, 0)
    sent = after.get(OBSERVE_SENT, 0) - before.get(OBSERVE_SENT, 0)
    n = args.requests
    return {"gateway_ms": gw * 1000 / n, "envoy_ms": env * 1000 / n,
            "stack_ms": (gw + env) * 1000 / n,
            "body_msgs": (sent - 2 * streams) / max(streams, 1),
            "p50_ms": statistics.median(times) * 1000}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,16,128,512", help="answer lengths, comma-separated")
    ap.add_argument("--requests", type=int, default=48, help="per stack, length and round")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--speed", type=float, default=8.0,
                    help="the simulated workers' speed (model seconds per wall second)")
    ap.add_argument("--out", help="report.md, results.json (every round) and a PNG here")
    args = ap.parse_args()
    lengths = [int(t) for t in args.tokens.split(",")]
    stacks: dict[str, LocalStack] = {}
    rows: list[dict[str, Any]] = []
    try:
        for way, envoy in WAYS.items():
            stacks[way] = LocalStack(StackConfig(workers=2, speed=args.speed, envoy=envoy,
                                                 scrape_interval=1.0)).start()
        for tokens in lengths:
            for stack in stacks.values():  # warm: caches, connections, the predictor
                measure(stack, argparse.Namespace(**{**vars(args), "requests": 8}), tokens,
                        "warm")
            for r in range(args.rounds):
                order = list(stacks) if r % 2 == 0 else list(reversed(stacks))
                for way in order:
                    row = {"tokens": tokens, "round": r, "way": way,
                           **measure(stacks[way], args, tokens, f"r{r}")}
                    rows.append(row)
                    print(f"{tokens:>4} tokens, round {r + 1}/{args.rounds}, {way:>11}: "
                          f"gateway {row['gateway_ms']:.2f} ms, Envoy {row['envoy_ms']:.2f} ms "
                          f"a request, {row['body_msgs']:.1f} body messages observed, "
                          f"p50 {row['p50_ms']:.0f} ms", flush=True)
    finally:
        for s in stacks.values():
            s.stop()
    text = report(rows, lengths, args)
    print(text)
    if args.out:
        from cachepilot.lab.output import StudyOutput

        out = StudyOutput(Path(args.out), "python " + " ".join(sys.argv))
        out.figure(plot(rows, lengths), "streamed-answers.png")
        out.write(text + "\n![CPU per request against answer length](streamed-answers.png)\n",
                  {"args": vars(args), "rows": rows})
    return 0


def _median(rows: list[dict[str, Any]], tokens: int, way: str, key: str) -> float:
    return statistics.median(x[key] for x in rows if x["tokens"] == tokens and x["way"] == way)


def report(rows: list[dict[str, Any]], lengths: list[int], args: argparse.Namespace) -> str:
    lines = ["# What observing a streamed answer costs", "",
             f"Streamed chat answers, 8 KB prompts, {args.requests} requests per stack, length "
             f"and round, {args.concurrency} in flight, {args.rounds} rounds (order "
             "alternating); medians over the rounds. `first-token`: the default; `whole`: "
             "the observing stream carries every body message to the end.", "",
             "| tokens | way | gateway CPU ms/request | Envoy CPU ms/request | body messages "
             "observed/request | p50 ms |", "|---:|---|---:|---:|---:|---:|"]
    for tokens in lengths:
        for way in WAYS:
            lines.append(f"| {tokens} | {way} | " + " | ".join(
                f"{_median(rows, tokens, way, k):.2f}"
                for k in ("gateway_ms", "envoy_ms", "body_msgs"))
                + f" | {_median(rows, tokens, way, 'p50_ms'):.0f} |")
    lines += ["", "first-token ÷ whole: the geometric mean of the per-round ratios [95 %, t on "
              "the log ratios]:", "",
              "| tokens | gateway CPU | Envoy CPU | gateway + Envoy | p50 |",
              "|---:|---:|---:|---:|---:|"]
    for tokens in lengths:
        cells = []
        for k in ("gateway_ms", "envoy_ms", "stack_ms", "p50_ms"):
            pair = {w: [x[k] for x in rows if x["tokens"] == tokens and x["way"] == w]
                    for w in WAYS}
            d = paired_ratio(pair["first-token"], pair["whole"])
            cells.append(f"{1 + d['rel']:.2f} [{1 + d['rel_lo']:.2f}, {1 + d['rel_hi']:.2f}]"
                         if d["n"] >= 2 else f"{1 + d['rel']:.2f}")
        lines.append(f"| {tokens} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], lengths: list[int]):  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for way, style in zip(WAYS, ("-", "--"), strict=True):
        for key, who, colour in (("gateway_ms", "gateway", "C0"), ("envoy_ms", "Envoy", "C1")):
            ax.plot(lengths, [_median(rows, t, way, key) for t in lengths], ls=style,
                    color=colour, marker="o", label=f"{who}, {way}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("answer tokens (streamed events)")
    ax.set_ylabel("CPU ms per request")
    ax.set_title("observing a streamed answer: until its first token, or whole")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    sys.exit(main())
