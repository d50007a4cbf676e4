"""Hit prediction on real vLLM workers: the exact directory (KV events) against the
routing-learned one, on the same requests (``cachepilot experiment real-model --engine vllm``,
or ``python -m cachepilot.lab.vllm_study``).

Two vLLM workers with a small KV cache (``--num-gpu-blocks-override``: prefixes evict each
other within a minute), requests that share system prompts (a few popular, most rare), sent
two at a time straight to the worker a policy picks: ``round_robin``, or ``cachepilot``:
CachePilot's directory in this process (``core.directory.PrefixDirectory`` fed by the
gateway's ``KVEventHub``), the longest exact-directory match, ties to the less busy worker
(not the whole gateway: no Envoy, no cost model). Before each request both
directories predict how many of its tokens the chosen worker has cached (the exact one from
the engine's events, the approximate one from where requests were sent, LRU at the engine's
capacity); the response's ``usage.prompt_tokens_details.cached_tokens`` is the truth.
Between phases the workers' prefix caches are reset (``/reset_prefix_cache``: vLLM then
publishes AllBlocksCleared), so every phase starts cold. Latency is the whole request at
``max_tokens=1``: its time to first token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cachepilot.core.directory import PrefixDirectory
from cachepilot.core.fingerprint import load_vllm_tokenizer, vllm_block_hashes, vllm_none_hash
from cachepilot.datalayer.kv_events import Endpoints, KVEventHub
from cachepilot.records.stats import imbalance
from cachepilot.sim.prompt_text import WORDS
from cachepilot.tooling.vllm.model import prepare
from cachepilot.tooling.vllm.worker import VllmWorkers, VllmWorkerSpec

POLICIES = ("round_robin", "cachepilot")


@dataclass(frozen=True)
class StudyConfig:
    seeds: tuple[int, ...] = (1, 2, 3)
    policies: tuple[str, ...] = POLICIES
    workers: int = 2
    requests: int = 30  # per phase
    groups: int = 8  # shared system prompts
    prefix_words: int = 420  # ~600 tokens each
    question_words: int = 30
    num_blocks: int = 64  # per worker: 2,048 tokens at block size 32, ~3 prompts
    max_model_len: int = 1024  # vLLM refuses a context longer than its KV cache holds
    concurrency: int = 2
    zipf: float = 1.1
    # Share of requests sent to a random worker behind the directories' backs (another
    # gateway replica, a client that bypasses the gateway): neither directory is told; the
    # engines' events still show what they stored and evicted. Scored: the other requests.
    outside: float = 0.0


@dataclass
class Sample:
    policy: str
    seed: int
    worker: str
    prompt_tokens: int
    measured: int  # cached_tokens from the engine
    exact: int  # predicted cached tokens, exact directory
    approx: int  # predicted cached tokens, routing-learned directory
    latency_s: float
    mode: str  # the exact directory's mode for the worker when the request was routed
    index: int = -1  # the request's number in the phase
    sent_s: float = 0.0  # since the phase's first request
    queued: int = 0  # the chosen worker's requests in flight when this one was sent


def _prompts(cfg: StudyConfig, seed: int) -> list[str]:
    rng = random.Random(seed)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(cfg.prefix_words))
                for _ in range(cfg.groups)]
    weights = [1 / (k + 1) ** cfg.zipf for k in range(cfg.groups)]
    out = []
    for i in range(cfg.requests):
        g = rng.choices(range(cfg.groups), weights)[0]
        q = " ".join(rng.choice(WORDS) for _ in range(cfg.question_words))
        out.append(f"System {g}: {prefixes[g]}\nRequest {i}: {q}")
    return out


def _capped(blocks: int, n_tokens: int, bs: int) -> int:
    return min(blocks, (n_tokens - 1) // bs) * bs  # vLLM computes at least one token


async def _phase(cfg: StudyConfig, policy: str, seed: int, ws: VllmWorkers,
                 exact: PrefixDirectory, tok: Any, none_hash: bytes,
                 hub: KVEventHub) -> list[Sample]:
    bs = ws.spec.block_size
    addrs = [w.address for w in ws.workers]
    approx = PrefixDirectory(cfg.num_blocks)
    for a in addrs:
        approx.add_worker(a, cfg.num_blocks)
    inflight = dict.fromkeys(addrs, 0)
    rr = [0]
    samples: list[Sample] = []
    queue = list(enumerate(_prompts(cfg, seed)))
    # The same requests go outside (to the same worker) under every policy of a seed.
    orng = random.Random(seed * 7919 + 1)
    outside = {i: addrs[orng.randrange(len(addrs))] for i in range(cfg.requests)
               if orng.random() < cfg.outside}
    import httpx  # the vllm extra (pip install 'cachepilot[vllm]')

    async with httpx.AsyncClient(timeout=300) as client:
        for a in addrs:  # cold start: clear every cache (vLLM publishes AllBlocksCleared)
            r = await client.post(f"http://{a}/reset_prefix_cache")
            r.raise_for_status()
            # An idle engine publishes at its next step only: a one-token request (no full
            # block, nothing stored) makes it step, and the clear reaches the directory.
            r = await client.post(f"http://{a}/v1/completions", json={
                "model": ws.spec.served_name, "prompt": "Hi", "max_tokens": 1})
            r.raise_for_status()
        t0 = time.monotonic()
        while any(exact.event_blocks(a) for a in addrs):
            if time.monotonic() - t0 > 30:
                raise RuntimeError("the workers' caches did not clear")
            await asyncio.sleep(0.05)
        start = time.monotonic()

        async def elsewhere(prompt: str, worker: str) -> None:
            r = await client.post(f"http://{worker}/v1/completions", json={
                "model": ws.spec.served_name, "prompt": prompt, "max_tokens": 1,
                "temperature": 0})
            r.raise_for_status()

        async def one(index: int, prompt: str) -> None:
            ids = tok(prompt)
            hashes = vllm_block_hashes(ids, bs, none_hash)
            m_exact = exact.match(hashes, addrs)
            if policy == "cachepilot":
                best = max(m_exact.values())
                tied = [a for a in addrs if m_exact[a] == best]
                chosen = min(tied, key=lambda a: (inflight[a], (addrs.index(a) - rr[0])
                                                  % len(addrs)))
            else:
                chosen = addrs[rr[0] % len(addrs)]
            rr[0] += 1
            pred_exact = _capped(m_exact[chosen], len(ids), bs)
            pred_approx = _capped(approx.match(hashes, [chosen])[chosen], len(ids), bs)
            approx.insert(chosen, hashes)
            exact.insert(chosen, hashes)  # pending until the engine announces the blocks
            mode, queued = hub.mode(chosen), inflight[chosen]
            inflight[chosen] += 1
            t0 = time.monotonic()
            r = await client.post(f"http://{chosen}/v1/completions", json={
                "model": ws.spec.served_name, "prompt": prompt, "max_tokens": 1,
                "temperature": 0})
            latency = time.monotonic() - t0
            inflight[chosen] -= 1
            r.raise_for_status()
            usage = r.json()["usage"]
            samples.append(Sample(policy, seed, chosen, usage["prompt_tokens"],
                                  usage["prompt_tokens_details"]["cached_tokens"] or 0,
                                  pred_exact, pred_approx, latency, mode, index,
                                  round(t0 - start, 3), queued))

        async def lane() -> None:
            while queue:
                i, prompt = queue.pop(0)
                await (elsewhere(prompt, outside[i]) if i in outside else one(i, prompt))

        await asyncio.gather(*(lane() for _ in range(cfg.concurrency)))
    return samples


def score(samples: list[Sample], key: str) -> dict[str, float]:
    """Hit prediction (a hit: any cached token) and token-exact agreement."""
    tp = sum(1 for s in samples if getattr(s, key) > 0 and s.measured > 0)
    fp = sum(1 for s in samples if getattr(s, key) > 0 and s.measured == 0)
    fn = sum(1 for s in samples if getattr(s, key) == 0 and s.measured > 0)
    exact_tokens = sum(1 for s in samples if getattr(s, key) == s.measured)
    return {"precision": tp / (tp + fp) if tp + fp else 1.0,
            "recall": tp / (tp + fn) if tp + fn else 1.0,
            "tokens_exact": exact_tokens / len(samples) if samples else 0.0,
            "tp": tp, "fp": fp, "fn": fn}


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def phase_record(samples: list[Sample], seed: int, policy: str, wall_s: float,
                 load: tuple[float, float]) -> dict[str, Any]:
    """One (seed, policy) phase in the shape the real-worker report reads
    (:func:`cachepilot.lab.real_peers_report.analyse`: workload, seed, router and
    the TTFT / hit-rate / imbalance figures), plus hit prediction by both directories."""
    lat = [s.latency_s for s in samples]
    per_worker: dict[str, int] = {}
    for s in samples:
        per_worker[s.worker] = per_worker.get(s.worker, 0) + s.prompt_tokens
    return {"workload": "vllm", "seed": seed, "router": policy,
            "requests": len(samples), "errors": 0,
            "ttft_p50_s": statistics.median(lat), "ttft_p90_s": _q(lat, 0.9),
            "ttft_p99_s": _q(lat, 0.99), "ttft_mean_s": statistics.fmean(lat),
            "token_hit_rate": sum(s.measured for s in samples)
            / sum(s.prompt_tokens for s in samples),
            "imbalance": imbalance(per_worker.values()),
            "events": score(samples, "exact"), "approximate": score(samples, "approx"),
            "wall_s": round(wall_s, 1), "loadavg_1m": [round(x, 2) for x in load],
            "modes": sorted({s.mode for s in samples})}


def summarise(samples: list[Sample]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for policy in sorted({s.policy for s in samples}):
        ps = [s for s in samples if s.policy == policy]
        hits = [s.latency_s for s in ps if s.exact > 0]
        misses = [s.latency_s for s in ps if s.exact == 0]
        out[policy] = {
            "requests": len(ps), "events": score(ps, "exact"), "approximate": score(ps, "approx"),
            "ttft_p50_s": statistics.median(s.latency_s for s in ps),
            "ttft_p90_s": _q([s.latency_s for s in ps], 0.9),
            "ttft_p50_predicted_hit_s": statistics.median(hits) if hits else None,
            "ttft_p50_predicted_miss_s": statistics.median(misses) if misses else None,
            "token_hit_rate": sum(s.measured for s in ps) / sum(s.prompt_tokens for s in ps),
            "modes": sorted({s.mode for s in ps})}
    return out


async def run(cfg: StudyConfig, venv: Path, log_dir: Path,
              progress: Any = print) -> dict[str, Any]:
    """Every (seed, policy) phase on two fresh-cache workers; the phases' records, every
    request's sample (no prompt text) and the subscribers' counters. Worker logs go to
    ``log_dir``."""
    model = prepare(venv)
    spec = VllmWorkerSpec(max_model_len=cfg.max_model_len,
                          extra_args=("--num-gpu-blocks-override", str(cfg.num_blocks)),
                          # /reset_prefix_cache between phases is a dev-mode endpoint
                          extra_env=(("VLLM_SERVER_DEV_MODE", "1"),))
    tok = load_vllm_tokenizer(str(model / "tokenizer.json"))
    none_hash = vllm_none_hash(spec.hash_seed)
    log_dir.mkdir(parents=True, exist_ok=True)
    ws = VllmWorkers(venv, model, spec, state_dir=log_dir)
    # A cold prefill takes 10-30 s on this shared 2-core CPU with two workers (seen: 29.5 s
    # under load): routed blocks stay pending for 30-60 s.
    hub = KVEventHub(heartbeat_every=1.0, replay_timeout=2.0, stale_after=30.0,
                     pending_every=30.0)
    exact = PrefixDirectory(cfg.num_blocks)
    samples: list[Sample] = []
    phases: list[dict[str, Any]] = []
    t_start, load_start = time.monotonic(), os.getloadavg()
    try:
        ws.start(cfg.workers, base_port=8300, base_events_port=5757)
        progress(f"[study] workers ready in {await asyncio.to_thread(ws.wait_ready, 600):.0f} s")
        for w in ws.workers:
            exact.add_worker(w.address, cfg.num_blocks)
            hub.attach(w.address, Endpoints(w.events_endpoint, w.replay_endpoint, "kv-events"),
                       exact)
        t0 = time.monotonic()
        while any(hub.mode(w.address) != "exact" for w in ws.workers):
            if time.monotonic() - t0 > 30:
                raise RuntimeError(f"KV events not exact after 30 s: {hub.status()}")
            await asyncio.sleep(0.1)
        for seed in cfg.seeds:
            for i in range(len(cfg.policies)):
                policy = cfg.policies[(i + seed) % len(cfg.policies)]  # order rotated per seed
                t0, load0 = time.monotonic(), os.getloadavg()[0]
                got = await _phase(cfg, policy, seed, ws, exact, tok, none_hash, hub)
                samples += got
                ph = phase_record(got, seed, policy, time.monotonic() - t0,
                                  (load0, os.getloadavg()[0]))
                phases.append(ph)
                progress(f"[study] seed {seed} {policy}: {len(got)} requests in "
                         f"{ph['wall_s']:.0f} s; events P/R {ph['events']['precision']:.3f}/"
                         f"{ph['events']['recall']:.3f}, approximate "
                         f"{ph['approximate']['precision']:.3f}/"
                         f"{ph['approximate']['recall']:.3f}; TTFT p50 {ph['ttft_p50_s']:.2f} s"
                         f" p90 {ph['ttft_p90_s']:.2f} s; load {ph['loadavg_1m']}")
    finally:
        status = hub.status()
        await hub.stop()
        await asyncio.to_thread(ws.stop)
    return {"config": {**asdict(cfg), "routers": list(cfg.policies), "block_size":
                       spec.block_size, "hash_seed": spec.hash_seed},
            "workloads": {"vllm": {"kind": "shared system prompts (Zipf)",
                                   "groups": cfg.groups, "concurrency": cfg.concurrency}},
            "phases": phases, "summary": summarise(samples), "subscribers": status,
            "samples": [asdict(s) for s in samples],
            "wall_s": round(time.monotonic() - t_start, 1),
            "loadavg_start": [round(x, 2) for x in load_start],
            "loadavg_end": [round(x, 2) for x in os.getloadavg()]}


def main(argv: list[str] | None = None) -> int:
    from cachepilot.lab.output import StudyOutput
    from cachepilot.lab.vllm_report import write_outputs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", type=Path, default=Path(".venv-vllm"))
    ap.add_argument("--out", type=Path, default=Path("docs/results/vllm"))
    ap.add_argument("--logs", type=Path, default=Path("runs/vllm-study"))
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--requests", type=int, default=StudyConfig.requests)
    args = ap.parse_args(argv)
    cfg = StudyConfig(seeds=tuple(int(s) for s in args.seeds.split(",")),
                      requests=args.requests)
    data = asyncio.run(run(cfg, args.venv, args.logs))
    (args.logs / "vllm-study.json").write_text(json.dumps(data, indent=1))  # before the report
    command = (f"python -m cachepilot.lab.vllm_study --seeds {args.seeds} "
               f"--requests {args.requests} --out {args.out}")
    write_outputs(data, StudyOutput(args.out, command))
    print(json.dumps(data["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
