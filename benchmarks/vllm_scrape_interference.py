"""Does the gateway beside a vLLM worker slow the engine down, and is it the metrics scrape?

On real vLLM workers, CachePilot's requests took a median 9-36 ms longer than a peer router's
at the *same* cache outcome (``real_peers_diagnosis.py --samples``), while the gateway's own
TTFT is within ~2 ms of the client's: the time goes in the engine, not in placement. This
measures one worker's TTFT, requests sent to it directly (no router in the path), while
different things run beside it, in interleaved rounds:

- ``none``: no router process at all;
- ``gateway-scrape-N``: the gateway (KV events, ``/metrics`` scraped every N s) + Envoy, for
  each N of ``--scrape-intervals`` (default 0.25, 1 and 5: the old CLI default, vLLM's
  default since, and a slow one);
- ``sglang``: sglang-router in front of the workers (what the peer costs the engine).

Each trial is a cold request (a new document) and then a warm one (same document, new
question), one at a time. Prints the median TTFT per variant and its ratio to ``none``.

With ``--through-router`` the requests go *through* each router instead (``none``: straight
to the worker, as before), so the table is what each router's path adds to TTFT, the
routing and the proxy included; ``gateway-no-observe`` is the gateway without its observing
stream (``--no-observe-responses``).

    CACHEPILOT_VLLM_VENV=.venv-vllm python benchmarks/vllm_scrape_interference.py --rounds 4 \
        --trials 10 [--scrape-intervals 0.25,1,5] [--through-router]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time

import aiohttp

from cachepilot.tooling.llamacpp.routers import ROUTERS
from cachepilot.tooling.loadgen import COMPLETIONS, one_request
from cachepilot.tooling.vllm.stack import VllmStack, missing

WORDS = [
    "alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "market", "engine", "paper",
    "garden", "window", "signal", "copper", "harbor", "lantern", "meadow", "orbit", "prism",
    "quartz",
]


class ScrapeStack(VllmStack):
    """The stack with the gateway's ``--scrape-interval`` set."""

    scrape_s: float = 0.25
    observe: bool = True

    def gateway_args(self, decisions=None):  # type: ignore[no-untyped-def]
        return [*super().gateway_args(decisions), "--scrape-interval", str(self.scrape_s),
                *([] if self.observe else ["--no-observe-responses"])]


def document(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def trial(url: str, model: str, doc: str, rng: random.Random) -> tuple[float, float]:
    """TTFT (ms) of a cold request for ``doc`` and then of a warm one."""
    out = []
    async with aiohttp.ClientSession() as session:
        for _ in range(2):
            q = f"\nQuestion {rng.randrange(10**9)}: summarise."
            r = await one_request(session, url, {
                "model": model, "prompt": doc + q, "max_tokens": 4, "stream": True,
                "ignore_eos": True,
                "stream_options": {"include_usage": True}}, COMPLETIONS)
            if not r.ok:
                raise RuntimeError(f"request failed: {r.status} {r.error}")
            # None: every token streamed was empty text (rare); the pair is dropped
            out.append(float("nan") if r.ttft_s is None else r.ttft_s * 1000)
    return out[0], out[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trials", type=int, default=6, help="cold+warm pairs per variant/round")
    ap.add_argument("--words", type=int, default=900)
    ap.add_argument("--scrape-intervals", default="0.25,1,5",
                    help="the gateway's --scrape-interval values to compare (s, comma-separated)")
    ap.add_argument("--through-router", action="store_true",
                    help="send the requests through each router, not straight to the worker")
    args = ap.parse_args()
    why = missing()
    if why:
        print(why, file=sys.stderr)
        return 2
    try:
        intervals = {f"gateway-scrape-{float(x):g}": float(x)
                     for x in args.scrape_intervals.split(",")}
    except ValueError:
        print(f"--scrape-intervals: not a list of seconds: {args.scrape_intervals!r}",
              file=sys.stderr)
        return 2
    variants = ["none", *intervals, "sglang"]
    if args.through_router:
        variants.insert(-1, "gateway-no-observe")
        intervals["gateway-no-observe"] = 1.0
    cold: dict[str, list[float]] = {v: [] for v in variants}
    warm: dict[str, list[float]] = {v: [] for v in variants}
    rng = random.Random(7)
    stack = ScrapeStack(workers=2, log_dir=tempfile.mkdtemp(prefix="vllm-interf-"))
    stack.start_workers()
    try:
        worker0 = f"http://{stack.worker_addresses[0]}"
        for rnd in range(args.rounds):
            order = variants[:]
            rng.shuffle(order)
            for v in order:
                if v.startswith("gateway"):
                    stack.scrape_s, stack.observe = intervals[v], v != "gateway-no-observe"
                    stack.start_router("priced", None)
                elif v == "sglang":
                    stack.start_router(None, ROUTERS["sglang_cache_aware"])
                time.sleep(3.0)  # let the router settle into its steady state
                for _ in range(args.trials):
                    url = stack.url if args.through_router and v != "none" else worker0
                    c, w = asyncio.run(trial(url, stack.spec.served_name,
                                             document(rng, args.words), rng))
                    if c == c and w == w:  # not NaN
                        cold[v].append(c)
                        warm[v].append(w)
                stack.stop_router()
                print(f"round {rnd + 1}/{args.rounds} {v}: cold "
                      f"{statistics.median(cold[v]):.0f} ms, warm "
                      f"{statistics.median(warm[v]):.0f} ms", flush=True)
    finally:
        stack.stop()
    base_c, base_w = statistics.median(cold["none"]), statistics.median(warm["none"])
    print("\n| beside the worker | n | cold p50 ms | ×none | warm p50 ms | ×none |")
    print("|---|---|---|---|---|---|")
    for v in variants:
        c, w = statistics.median(cold[v]), statistics.median(warm[v])
        print(f"| {v} | {len(cold[v])} | {c:.0f} | {c / base_c:.2f} | {w:.0f} | "
              f"{w / base_w:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
