"""Where a long prompt's routing time goes, stage by stage, in process (no gRPC, no Envoy).

For each prompt size: eight completions bodies sharing a document (99 % of the prompt) with
a tail of their own, routed in turn between two workers; the median over repetitions of
each stage: protobuf parse of the ext_proc message, JSON parse, fingerprint (a prompt the
router has not seen begin this way, and one it has), directory match and insert, the whole
``Router.route``, the decision record (``decision_to_record`` + JSON, the log's writer
thread), and a replica placement's encoding (the NATS bus's JSON, the local peers' frame).
With ``--tokenizer``: exact mode's tokenising and hashing, whole and spliced.

    python benchmarks/prompt_stages.py [--sizes 8,64,220,1024] [--tokenizer tokenizer.json]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from cachepilot.core import BlockConfig, Pool, PoolSpec, Router, WorkerMetrics, parse_openai_body
from cachepilot.core.fingerprint import fingerprint
from cachepilot.core.sync import Placed
from cachepilot.gateway import replica_bus
from cachepilot.records.schema import decision_to_record


def timed(f: Callable[[], Any], n: int = 15) -> float:
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        xs.append(time.perf_counter() - t0)
    return float(np.median(xs)) * 1000


def bodies(kb: int, n: int = 8) -> list[bytes]:
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyz      \n"
    size = kb * 1024
    head = "".join(rng.choices(alphabet, k=size * 99 // 100))
    return [orjson.dumps({"model": "m", "max_tokens": 1, "prompt": (
        head + f" question {i}: " + "".join(rng.choices(alphabet, k=size // 100)))[:size]})
        for i in range(n)]


def router(now: float) -> Router:
    pool = Pool(PoolSpec(block=BlockConfig(16, 4.0), capacity_blocks=1 << 20))
    for i in range(2):
        addr = f"10.0.0.{i}:8000"
        pool.upsert_worker(addr)
        pool.update_metrics(addr, WorkerMetrics(waiting=0, running=1, kv_usage=0.1,
                                                num_blocks=1 << 20, scraped_at=now))
    return Router([pool], id_prefix="bench")


def stages(kb: int) -> dict[str, float]:
    raw = bodies(kb)
    now = time.time()
    r = router(now)
    pool = r.pools["default"]
    msg = ep.ProcessingRequest(request_body=ep.HttpBody(body=raw[0], end_of_stream=True)
                               ).SerializeToString()
    req = parse_openai_body("/v1/completions", raw[0])
    cfg = pool.spec.block
    out = {"blocks": float(len(fingerprint("m", cfg, text=req.prompt).hashes)),
           "protobuf": timed(lambda: ep.ProcessingRequest.FromString(msg)),
           "json": timed(lambda: parse_openai_body("/v1/completions", raw[0])),
           "fingerprint, unseen": timed(lambda: fingerprint("m", cfg, text=req.prompt))}
    for b in raw:  # the router has now seen each prompt once
        r.route(parse_openai_body("/v1/completions", b), now)
    reqs = [parse_openai_body("/v1/completions", b) for b in raw]
    k = iter(range(10**9))
    out["fingerprint, seen prefix"] = timed(lambda: r.fingerprint(reqs[next(k) % 8], pool))
    fps = [r.fingerprint(q, pool) for q in reqs]
    chained = {"chained": True} if "chained" in pool.directory.match.__code__.co_varnames \
        else {}  # (the code before issue 26 scans)
    out["match"] = timed(lambda: pool.directory.match(fps[next(k) % 8].hashes, pool.workers,
                                                      **chained))
    out["insert"] = timed(lambda: pool.directory.insert("10.0.0.0:8000",
                                                        fps[next(k) % 8].hashes))
    out["route"] = timed(lambda: r.route(reqs[next(k) % 8], now))
    d = r.route(reqs[0], now)
    out["record"] = timed(lambda: orjson.dumps(decision_to_record(d)))
    placed = [Placed("a", d.id, "default", d.chosen, d.hashes, 1)]
    out["placement, bus JSON"] = timed(lambda: replica_bus.encode(placed))
    try:
        from cachepilot.gateway import local_peers
    except ImportError:  # before issue 26
        return out
    out["placement, local frame"] = timed(lambda: local_peers.encode(local_peers.EVENTS,
                                                                     placed))
    return out


def exact_stages(kb: int, tokenizer: str) -> dict[str, float]:
    from cachepilot.core.fingerprint import (
        HFTokens,
        _hf_tokenizer,
        vllm_block_hashes,
        vllm_none_hash,
    )
    from cachepilot.core.prefix_cache import ChainCache, SplicingEncoder

    tok = HFTokens(_hf_tokenizer(tokenizer, "--tokenizer"), special=True)
    texts = [orjson.loads(b)["prompt"] for b in bodies(kb)]
    enc = SplicingEncoder(tok, verify_first=0, verify_every=1 << 30)
    chains = ChainCache()
    none = vllm_none_hash("0")
    ids = [tok(t) for t in texts]
    enc(texts[0], True)
    chains.vllm_hashes(ids[0], 16, none)
    k = iter(range(1, 10**9))
    return {"tokens": float(len(ids[1])),
            "tokenise, whole": timed(lambda: tok(texts[1]), n=3),
            "tokenise, spliced": timed(lambda: enc(texts[next(k) % 8], True)),
            "hash, whole": timed(lambda: vllm_block_hashes(ids[1], 16, none), n=5),
            "hash, reusing digests": timed(lambda: chains.vllm_hashes(ids[next(k) % 8], 16,
                                                                      none))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8,64,220,1024")
    ap.add_argument("--tokenizer", default=None)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = {kb: stages(kb) for kb in sizes}
    names = list(next(iter(rows.values())))
    print("| ms (median) | " + " | ".join(f"{kb} KB" for kb in sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    for n in names:
        cells = [f"{rows[kb][n]:,.0f}" if n == "blocks" else f"{rows[kb][n]:.3f}"
                 for kb in sizes]
        print(f"| {n} | " + " | ".join(cells) + " |")
    if args.tokenizer:
        ex = {kb: exact_stages(kb, args.tokenizer) for kb in sizes if kb <= 256}
        print("\nexact mode (sha256_cbor, block 16):\n")
        print("| ms (median) | " + " | ".join(f"{kb} KB" for kb in ex) + " |")
        print("|---|" + "---:|" * len(ex))
        for n in next(iter(ex.values())):
            cells = [f"{ex[kb][n]:,.0f}" if n == "tokens" else f"{ex[kb][n]:.2f}" for kb in ex]
            print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
