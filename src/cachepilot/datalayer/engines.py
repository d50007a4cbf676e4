"""One adapter per engine: how to read a worker's state over HTTP into :class:`WorkerMetrics`.

Every engine serves Prometheus text (parsed by :mod:`cachepilot.datalayer.engine_metrics`);
llama.cpp also has ``GET /props`` (``total_slots`` and the context per slot), which its
metrics lack but slot-eviction pricing needs. Props never change while the server runs, so
they are read once per worker and again after it failed a scrape or restarted (its
counters went back). Its ``GET /slots`` says how far each running prompt has got
(``n_prompt_tokens_processed`` while no token is decoded yet): read every round in which
its metrics say a request is processing, so a request for a document another request is
still prefilling is priced for the rest only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import aiohttp
import orjson

from cachepilot.core.workers import WorkerMetrics, WorkerState
from cachepilot.datalayer.engine_metrics import ENGINES, parse_metrics

log = logging.getLogger("cachepilot.scrape")

Slots = tuple[int | None, int | None]  # (slots, tokens of context per slot)
# One metrics scrape: (session, URL, engine, timeout in s, clock) → metrics; raises on any
# failure. Replaceable, so tests can script engines without HTTP.
ScrapeFn = Callable[[aiohttp.ClientSession, str, str, float, Callable[[], float]],
                    Awaitable[WorkerMetrics]]


# llama-server (cpp-httplib) polls every kept-alive connection while it waits for the next
# request, on the cores it computes on: with the gateway's scrape connection kept open an
# idle worker used ~0.45 % of a core, with it closed after each scrape ~0.05 %
# (benchmarks/llama_idle_cpu.py). A scrape every second keeps one always open.
CLOSE = {"Connection": "close"}
_CLOSE_AFTER_SCRAPE = frozenset({"llamacpp"})


async def scrape_once(session: aiohttp.ClientSession, url: str, engine: str, timeout_s: float,
                      now: Callable[[], float] = time.time) -> WorkerMetrics:
    """One scrape; raises on HTTP errors, timeouts and unparseable text."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    headers = CLOSE if engine in _CLOSE_AFTER_SCRAPE else None
    async with session.get(url, timeout=timeout, headers=headers) as resp:
        resp.raise_for_status()
        text = await resp.text()
    return parse_metrics(text, engine, now())


def props_url(metrics_url: str) -> str:
    """llama-server's /props, beside its /metrics."""
    base = metrics_url
    return (base[: -len("/metrics")] if base.endswith("/metrics") else base.rstrip("/")) + "/props"


def parse_props(body: bytes) -> Slots:
    """llama-server's ``/props`` → (total_slots, n_ctx of a slot); None where absent."""
    props: Any = orjson.loads(body)
    if not isinstance(props, dict):
        raise ValueError("/props is not a JSON object")
    settings = props.get("default_generation_settings") or {}
    n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
    slots, n_ctx = props.get("total_slots"), n_ctx or props.get("n_ctx")
    return (slots if isinstance(slots, int) and slots > 0 else None,
            n_ctx if isinstance(n_ctx, int) and n_ctx > 0 else None)


async def fetch_slots(session: aiohttp.ClientSession, url: str, timeout_s: float) -> Slots:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s),
                           headers=CLOSE) as resp:
        resp.raise_for_status()
        return parse_props(await resp.read())


def slots_url(metrics_url: str) -> str:
    """llama-server's /slots (without prompt text unless it runs with slot debugging),
    beside its /metrics."""
    return props_url(metrics_url)[: -len("/props")] + "/slots"


def parse_prefill_progress(body: bytes) -> int:
    """llama-server's ``/slots`` → prompt tokens processed so far by the slots still
    prefilling (processing, no token decoded yet). A slot whose request has produced a
    token is past its prefill; an idle one reports its last request."""
    slots: Any = orjson.loads(body)
    if not isinstance(slots, list):
        raise ValueError("/slots is not a JSON array")
    done = 0
    for s in slots:
        if not isinstance(s, dict) or not s.get("is_processing"):
            continue
        nxt = s.get("next_token") or [{}]
        decoded = nxt[0].get("n_decoded", 0) if isinstance(nxt, list) and nxt else 0
        processed = s.get("n_prompt_tokens_processed", 0)
        if not decoded and isinstance(processed, int) and processed > 0:
            done += processed
    return done


async def fetch_prefill_progress(session: aiohttp.ClientSession, url: str,
                                 timeout_s: float) -> int:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s),
                           headers=CLOSE) as resp:
        resp.raise_for_status()
        return parse_prefill_progress(await resp.read())


class Engine:
    """An engine whose metrics say all we read (vLLM, SGLang, the simulated worker)."""

    def __init__(self, name: str, scrape: ScrapeFn = scrape_once) -> None:
        self.name = name
        self._scrape = scrape

    async def scrape(self, session: aiohttp.ClientSession, w: WorkerState, url: str,
                     timeout_s: float, now: Callable[[], float]) -> WorkerMetrics:
        # aiohttp's own timeout bounds a real scrape; this one bounds any ScrapeFn, so a
        # hung one cannot stop its worker's loop (asyncio.timeout, not wait_for: see
        # cachepilot.operator.aio).
        async with asyncio.timeout(timeout_s + 1.0):
            return await self._scrape(session, url, self.name, timeout_s, now)

    def forget(self, address: str) -> None:
        """The worker failed a scrape or left: drop what was read once for it."""


class LlamaCpp(Engine):
    """llama-server: metrics, plus its slots from ``/props`` and the prefill in progress
    from ``/slots``."""

    def __init__(self, scrape: ScrapeFn = scrape_once, progress: bool = True) -> None:
        super().__init__("llamacpp", scrape)
        self._slots: dict[str, Slots] = {}  # by worker address, until a failure
        self.progress = progress
        # Tests replace it: (session, URL, timeout) → prompt tokens processed so far.
        self.fetch_progress: Callable[[aiohttp.ClientSession, str, float],
                                      Awaitable[int]] = fetch_prefill_progress

    async def scrape(self, session: aiohttp.ClientSession, w: WorkerState, url: str,
                     timeout_s: float, now: Callable[[], float]) -> WorkerMetrics:
        m = await super().scrape(session, w, url, timeout_s, now)
        old = w.metrics
        restarted = (old is not None and old.prefix_queries is not None
                     and m.prefix_queries is not None and m.prefix_queries < old.prefix_queries)
        if restarted or w.address not in self._slots:
            try:
                self._slots[w.address] = await fetch_slots(session, props_url(url), timeout_s)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                # Metrics without slots still route; /props is read again next round.
                log.warning("reading %s failed: %s", props_url(url), exc)
                return m
        slots, slot_tokens = self._slots[w.address]
        done = 0
        # Nothing processing: no prefill to report, and a scrape less for the engine (its
        # main loop answers /slots, on the cores it computes on).
        if self.progress and m.running > 0:
            try:
                done = await self.fetch_progress(session, slots_url(url), timeout_s)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                # Without it a prefill in progress counts whole, as before /slots was read.
                log.debug("reading %s failed: %s", slots_url(url), exc)
        return replace(m, slots=slots, slot_tokens=slot_tokens, prefill_done_tokens=done)

    def forget(self, address: str) -> None:
        self._slots.pop(address, None)  # read again once it is back (maybe restarted)


def adapters(scrape: ScrapeFn = scrape_once) -> dict[str, Engine]:
    """A fresh adapter for every engine in :data:`ENGINES` (they hold per-worker state)."""
    out = {name: Engine(name, scrape) for name in ENGINES}
    out["llamacpp"] = LlamaCpp(scrape)
    return out
