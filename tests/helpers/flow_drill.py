"""The flow-control drill's traffic (tests/gateway/test_flow_drill.py, benchmarks/
flow_drill.py): a steady tenant alone, then with a flood at four times the pool's capacity, a
critical band and a sheddable band, each request's reply as the client saw it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx
import numpy as np

from cachepilot.core.flow import info as fi

MODEL = "sim-llama-8b"
TTL_S = 2.0
# Two workers of one batch slot, 40 output tokens a request (~0.5 s): ~4 requests/s. Small,
# so the test's own client (one Python process) stays far from its limits.
CAPACITY_RPS = 4.0
FLOOD_RPS = 4 * CAPACITY_RPS
STEADY_RPS = 1.0
PHASE_S = 8.0
OUTPUT_TOKENS = 40


@dataclass
class Reply:
    tenant: str
    status: int
    seconds: float  # request sent → first body byte (or the error)
    retry_after: str | None
    reason: str | None
    decision: str | None


def _body(tenant: str, i: int) -> dict:
    doc = f"You are {tenant}'s assistant. Answer from {tenant}'s manual. " * 30
    return {"model": MODEL, "max_tokens": OUTPUT_TOKENS, "stream": True,
            "messages": [{"role": "system", "content": doc},
                         {"role": "user", "content": f"{tenant} question {i}"}]}


async def _tenant(c: httpx.AsyncClient, tenant: str, rate: float, seconds: float,
                  out: list[Reply], **headers: str) -> None:
    async def one(i: int) -> None:
        await asyncio.sleep(i / rate)
        sent = time.monotonic()
        hdrs = {"x-gateway-inference-fairness-id": tenant, **headers}
        async with c.stream("POST", "/v1/chat/completions", json=_body(tenant, i),
                            headers=hdrs) as r:
            first = None
            async for _ in r.aiter_bytes():
                first = first or time.monotonic()
        out.append(Reply(tenant, r.status_code, (first or time.monotonic()) - sent,
                         r.headers.get("retry-after"),
                         r.headers.get(fi.SHED_HEADER),
                         r.headers.get("x-cachepilot-decision-id")))

    await asyncio.gather(*(one(i) for i in range(int(rate * seconds))))


def p99(replies: list[Reply]) -> float:
    return float(np.percentile([r.seconds for r in replies], 99))


async def drill(url: str) -> tuple[list[Reply], list[Reply]]:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as c:
        alone: list[Reply] = []
        await _tenant(c, "steady", STEADY_RPS, PHASE_S, alone)
        both: list[Reply] = []
        await asyncio.gather(
            _tenant(c, "steady", STEADY_RPS, PHASE_S, both),
            _tenant(c, "flood", FLOOD_RPS, PHASE_S, both),
            # Once the flood has filled the pool: a critical band and a sheddable one.
            _late(_tenant(c, "ops", 0.5, PHASE_S - 3, both, **{"x-cachepilot-priority": "10"})),
            _late(_tenant(c, "batch", 1.0, PHASE_S - 3, both,
                          **{"x-cachepilot-priority": "-1"})))
    return alone, both


async def _late(coro) -> None:  # type: ignore[no-untyped-def]
    await asyncio.sleep(2.0)
    await coro
