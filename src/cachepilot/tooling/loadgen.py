"""An OpenAI-style load generator for the local stack: Poisson arrivals of prefix-sharing chat
requests, streamed, with TTFT measured at the client (first content chunk)."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import numpy as np
import orjson

_WORDS = (
    "the", "of", "and", "to", "in", "is", "for", "on", "with", "as", "by", "at", "from", "that",
    "this", "be", "are", "it", "an", "or", "was", "kernel", "cache", "block", "prefix", "token",
    "batch", "queue", "worker", "model", "prompt", "latency", "envoy", "route", "pool", "decode",
    "prefill", "memory", "schedule", "request", "response", "stream", "gateway", "system",
)


@dataclass(frozen=True)
class Workload:
    """Shared-prefix chat traffic: ``groups`` long system documents, each request one of them
    (uniformly) plus a short unique question."""

    groups: int = 32
    prefix_chars: int = 16_000  # ≈4k tokens at 4 chars/token
    suffix_chars: int = 400
    max_tokens: int = 32
    rate: float = 8.0  # requests/s, Poisson
    duration_s: float = 30.0
    seed: int = 7
    model: str = "sim-llama-8b"

    def documents(self) -> list[str]:
        rng = random.Random(self.seed)
        return [f"[doc {g}] " + _text(rng, self.prefix_chars) for g in range(self.groups)]


def _text(rng: random.Random, n: int) -> str:
    out: list[str] = []
    size = 0
    while size < n:
        w = rng.choice(_WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n]


@dataclass
class Result:
    ok: bool
    status: int
    ttft_s: float | None = None
    worker: str | None = None
    decision_id: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


@dataclass
class Summary:
    requests: int
    errors: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    throughput_rps: float
    cache_hit_rate: float
    imbalance: float
    per_worker: dict[str, int] = field(default_factory=dict)
    decision_ids: int = 0

    def to_dict(self) -> dict[str, object]:
        return {"requests": self.requests, "errors": self.errors,
                "ttft_p50_ms": round(self.ttft_p50_ms, 1),
                "ttft_p99_ms": round(self.ttft_p99_ms, 1),
                "throughput_rps": round(self.throughput_rps, 2),
                "cache_hit_rate": round(self.cache_hit_rate, 3),
                "imbalance": round(self.imbalance, 3), "per_worker": self.per_worker,
                "decision_ids": self.decision_ids}


async def one_request(session: aiohttp.ClientSession, url: str, body: dict[str, object]
                      ) -> Result:
    t0 = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            res = Result(ok=resp.status == 200, status=resp.status,
                         worker=resp.headers.get("x-cachepilot-worker"),
                         decision_id=resp.headers.get("x-cachepilot-decision-id"))
            if resp.status != 200:
                res.error = (await resp.read())[:200].decode(errors="replace")
                return res
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = orjson.loads(line[6:])
                choices = chunk.get("choices") or []
                if res.ttft_s is None and choices and choices[0].get("delta", {}).get("content"):
                    res.ttft_s = time.perf_counter() - t0
                usage = chunk.get("usage")
                if usage:
                    res.prompt_tokens = usage.get("prompt_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = details.get("cached_tokens") or 0
            return res
    except (TimeoutError, aiohttp.ClientError) as exc:
        return Result(ok=False, status=0, error=f"{type(exc).__name__}: {exc}")


async def run(url: str, w: Workload, progress: Callable[[int, int], None] | None = None
              ) -> tuple[list[Result], float]:
    """Send the workload open-loop; return results and the wall time from first send to last
    answer."""
    rng = random.Random(w.seed + 1)
    docs = w.documents()
    n = int(w.rate * w.duration_s)
    gaps = np.random.default_rng(w.seed).exponential(1.0 / w.rate, n)
    results: list[Result] = []
    timeout = aiohttp.ClientTimeout(total=300)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        tasks: list[asyncio.Task[Result]] = []

        def done(t: asyncio.Task[Result]) -> None:
            results.append(t.result())
            if progress:
                progress(len(results), n)

        start = time.perf_counter()
        at = start
        for i in range(n):
            at += gaps[i]
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            body = {"model": w.model, "stream": True, "max_tokens": w.max_tokens,
                    "stream_options": {"include_usage": True},
                    "messages": [{"role": "system", "content": rng.choice(docs)},
                                 {"role": "user", "content": f"q{i}: " +
                                  _text(rng, w.suffix_chars)}]}
            t = asyncio.create_task(one_request(session, url, body))
            t.add_done_callback(done)
            tasks.append(t)
        await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def summarize(results: list[Result], wall_s: float) -> Summary:
    ok = [r for r in results if r.ok and r.ttft_s is not None]
    ttfts = np.array([r.ttft_s for r in ok]) * 1000.0 if ok else np.array([float("nan")])
    per_worker = Counter(r.worker for r in ok if r.worker)
    counts = list(per_worker.values())
    prompt = sum(r.prompt_tokens for r in ok)
    return Summary(
        requests=len(results), errors=len(results) - len(ok),
        ttft_p50_ms=float(np.percentile(ttfts, 50)), ttft_p99_ms=float(np.percentile(ttfts, 99)),
        throughput_rps=len(ok) / wall_s if wall_s else 0.0,
        cache_hit_rate=sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        imbalance=max(counts) / (sum(counts) / len(counts)) if counts else float("nan"),
        per_worker=dict(sorted(per_worker.items())),
        decision_ids=sum(1 for r in ok if r.decision_id))
