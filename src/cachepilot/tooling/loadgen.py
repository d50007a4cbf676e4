"""An OpenAI-style load generator for the local stack: requests drawn by the simulator's
workload generator (:func:`cachepilot.sim.workloads.generate`, so the demo's traffic is a
:class:`~cachepilot.sim.workloads.WorkloadSpec` like any simulated one) rendered as chat
text, sent open loop at their arrival times, streamed, with TTFT measured at the client
(first content chunk). :func:`summarize` reports the keys the simulator does."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from cachepilot.records.stats import imbalance, ttft_summary
from cachepilot.sim.prompt_text import chat_messages
from cachepilot.sim.workloads import SimRequest


@dataclass
class Result:
    """One request: what the client measured (and, when the caller asks the gateway, what
    it predicted)."""

    ok: bool
    status: int
    ttft_s: float | None = None
    worker: str | None = None
    decision_id: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # the worker's own count (usage.prompt_tokens_details)
    error: str | None = None
    label: str = ""  # the request's group (which shared document), for the caller
    predicted_hit: bool | None = None
    predicted_cached_tokens: int | None = None

    @property
    def measured_hit(self) -> bool:
        return self.cached_tokens > 0


def chat_body(req: SimRequest, model: str, chars_per_token: float = 4.0,
              **extra: Any) -> dict[str, Any]:
    """A streamed chat completion for one generated request (``max_tokens`` its output)."""
    return {"model": model, "stream": True, "max_tokens": req.max_tokens,
            "stream_options": {"include_usage": True},
            "messages": chat_messages(req, chars_per_token), **extra}


def completion_body(req: SimRequest, model: str, chars_per_token: float = 4.0,
                    **extra: Any) -> dict[str, Any]:
    """The same request as a streamed text completion: the chat messages' text, shared part
    first (``/v1/completions``)."""
    text = "\n".join(m["content"] for m in chat_messages(req, chars_per_token))
    return {"model": model, "stream": True, "max_tokens": req.max_tokens,
            "stream_options": {"include_usage": True}, "prompt": text, **extra}


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


async def one_request(session: aiohttp.ClientSession, url: str, body: dict[str, object],
                      path: str = CHAT) -> Result:
    t0 = time.perf_counter()
    try:
        async with session.post(f"{url}{path}", json=body) as resp:
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
                if res.ttft_s is None and choices and (
                        choices[0].get("text") or (choices[0].get("delta") or {}).get("content")):
                    res.ttft_s = time.perf_counter() - t0
                usage = chunk.get("usage")
                if usage:
                    res.prompt_tokens = usage.get("prompt_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = details.get("cached_tokens") or 0
            return res
    except (TimeoutError, aiohttp.ClientError) as exc:
        return Result(ok=False, status=0, error=f"{type(exc).__name__}: {exc}")


async def run(url: str, arrivals: Sequence[float], bodies: Sequence[dict[str, Any]],
              progress: Callable[[int, int], None] | None = None, timeout_s: float = 300.0,
              path: str = CHAT) -> tuple[list[Result], float]:
    """Send ``bodies[i]`` to ``path`` (chat or text completions) at ``arrivals[i]`` seconds
    after the start, open loop; return the results in the same order and the wall time from
    the start to the last answer."""
    n = len(bodies)
    done_count = 0
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks: list[asyncio.Task[Result]] = []

        def done(_: asyncio.Task[Result]) -> None:
            nonlocal done_count
            done_count += 1
            if progress:
                progress(done_count, n)

        start = time.perf_counter()
        t0 = arrivals[0] if len(arrivals) else 0.0
        for at, body in zip(arrivals, bodies, strict=True):
            await asyncio.sleep(max(0.0, start + at - t0 - time.perf_counter()))
            t = asyncio.create_task(one_request(session, url, body, path))
            t.add_done_callback(done)
            tasks.append(t)
        results = list(await asyncio.gather(*tasks))
        return results, time.perf_counter() - start


def summarize(results: Sequence[Result], wall_s: float) -> dict[str, Any]:
    """``requests``, ``errors`` (count), ``ttft_p50_s``/``p90``/``p99``/``ttft_mean_s``
    (seconds), ``throughput_rps``, ``token_hit_rate`` (cached / prompt tokens, as the
    workers report them), ``imbalance`` (requests of the busiest worker over the mean),
    ``per_worker`` and ``decision_ids`` (answers that carried one)."""
    ok = [r for r in results if r.ok and r.ttft_s is not None]
    per_worker = Counter(r.worker for r in ok if r.worker)
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(results), "errors": len(results) - len(ok),
        **{k: round(v, 4) for k, v in ttft_summary(r.ttft_s for r in ok).items()},
        "throughput_rps": round(len(ok) / wall_s, 2) if wall_s else 0.0,
        "token_hit_rate": round(sum(r.cached_tokens for r in ok) / prompt, 3) if prompt
        else float("nan"),
        "imbalance": round(imbalance(per_worker.values()), 3),
        "per_worker": dict(sorted(per_worker.items())),
        "decision_ids": sum(1 for r in ok if r.decision_id),
    }
