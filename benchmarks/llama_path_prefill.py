"""Does the router in front slow llama-server's own prefill?

In the real-worker studies the same cold prompt's prefill, as llama-server itself times it,
took a few per cent longer when CachePilot routed than when sglang-router did
(``real_peers_diagnosis.py``: the engine's own cold prefills), even with the other worker
idle; a gateway merely scraping beside a worker did not slow it
(``llama_scrape_interference.py --beside gateway``). This isolates the request path: the
same stack as the studies (``LlamaStack``: two llama-server workers, one thread and one slot
each, then Envoy and the gateway, or a peer router, in front), one cold prompt at a time (new
text each, ``--words`` words, one token out), so no other request runs. Every round starts
each router's stack afresh, in alternating order, and sends it ``--prompts`` prompts; the
prompt lengths are the same for every router. The measure is llama-server's own
``timings.prompt_ms`` from the answer (the engine's prefill, not the path's), and the
client's latency beside it. Prints the medians and the paired ratios (prompt i of round r
under CachePilot over the same under the peer; ``paired_ratio``: t on the log ratios).
``--variants`` adds CachePilot stacks with one thing changed: ``no-log`` (no decision log),
``scrape-N`` (the gateway scrapes every N s instead of llama.cpp's default).

    make .venv/.installed-peers
    python benchmarks/llama_path_prefill.py --rounds 3 --prompts 8
    python benchmarks/llama_path_prefill.py --rounds 4 --variants no-log,scrape-5
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

from cachepilot.lab.stats import paired_ratio
from cachepilot.tooling.llamacpp.routers import ROUTERS, peers_installed
from cachepilot.tooling.llamacpp.stack import LlamaStack
from cachepilot.tooling.llamacpp.worker import LlamaCppMissing

sys.path.insert(0, str(Path(__file__).parent))
from llama_scrape_interference import WORDS  # the same cold prompts' words


def phase(router: str, prompts: list[str]) -> list[tuple[float, float]]:
    """(engine prompt ms, client ms) of each prompt through ``router``'s fresh stack
    (``cachepilot:VARIANT``: CachePilot with one thing changed)."""
    name, _, variant = router.partition(":")
    spec = ROUTERS[name]
    stack = LlamaStack(workers=2, peer=None if spec.kind == "cachepilot" else spec,
                       policy=spec.policy, decision_log=variant != "no-log",
                       scrape_interval_s=(float(variant.removeprefix("scrape-"))
                                          if variant.startswith("scrape-") else None)).start()
    out = []
    try:
        with httpx.Client(timeout=120.0) as client:
            for p in prompts:
                t0 = time.perf_counter()
                r = client.post(stack.url + "/v1/completions",
                                json={"model": "m", "prompt": p, "max_tokens": 1})
                r.raise_for_status()
                out.append((float(r.json()["timings"]["prompt_ms"]),
                            (time.perf_counter() - t0) * 1000))
    finally:
        stack.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8, help="per router and round")
    ap.add_argument("--words", type=int, default=700, help="prompt length (fits the slot)")
    ap.add_argument("--peer", default="sglang_cache_aware")
    ap.add_argument("--variants", default="", help="no-log, scrape-N (comma-separated)")
    args = ap.parse_args()
    why = peers_installed([args.peer])
    if why:
        print(why, file=sys.stderr)
        return 2
    rng = random.Random(11)
    routers = ["cachepilot", args.peer,
               *(f"cachepilot:{v}" for v in args.variants.split(",") if v)]
    got: dict[str, list[tuple[float, float]]] = {r: [] for r in routers}
    try:
        for i in range(args.rounds):
            order = routers[i % len(routers):] + routers[:i % len(routers)]  # rotating
            texts = {r: [" ".join(rng.choice(WORDS) for _ in range(args.words))
                         for _ in range(args.prompts)] for r in routers}
            for r in order:
                got[r] += phase(r, texts[r])
                print(f"round {i + 1}/{args.rounds} {r}: engine prefill median "
                      f"{statistics.median(e for e, _ in got[r][-args.prompts:]):.0f} ms",
                      flush=True)
    except LlamaCppMissing as err:
        print(err, file=sys.stderr)
        return 2
    print(f"\n{args.words}-word cold prompts, one at a time, {args.rounds} rounds × "
          f"{args.prompts}")
    for r in routers:
        print(f"{r:>20}: engine prefill median {statistics.median(e for e, _ in got[r]):.0f} "
              f"ms, client {statistics.median(c for _, c in got[r]):.0f} ms")
    for r in [x for x in routers if x != args.peer]:
        for k, label in ((0, "engine prefill"), (1, "client latency")):
            d = paired_ratio([x[k] for x in got[r]], [x[k] for x in got[args.peer]])
            print(f"{r} ÷ {args.peer}, {label}: {1 + d['rel']:.3f} "
                  f"[{1 + d['rel_lo']:.3f}, {1 + d['rel_hi']:.3f}] (n = {d['n']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
