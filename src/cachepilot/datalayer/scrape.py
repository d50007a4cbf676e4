"""Fetch workers' Prometheus metrics into the router's pools, each worker on its own schedule.

Each worker has its own loop, so a slow or hung worker delays only its own refresh, never the
others'. A failed scrape (refused, reset, timed out, unparseable) marks the worker down at once
(:meth:`cachepilot.core.pool.Pool.update_metrics`); the next good one brings it back.

llama.cpp workers also report their slots (``GET /props``: ``total_slots`` and the context per
slot), read once per worker and again after it failed a scrape or restarted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import aiohttp
import orjson

from cachepilot.core.pool import Pool
from cachepilot.core.router import Router
from cachepilot.core.workers import WorkerMetrics, WorkerState
from cachepilot.datalayer.engine_metrics import parse_metrics

log = logging.getLogger("cachepilot.scrape")

Slots = tuple[int | None, int | None]  # (slots, tokens of context per slot)


def metrics_url(worker: WorkerState) -> str:
    """``labels['metrics_url']`` when the operator set one, else the serving port's /metrics."""
    return worker.labels.get("metrics_url") or f"http://{worker.address}/metrics"


def props_url(worker: WorkerState) -> str:
    """llama-server's /props, beside its /metrics."""
    base = metrics_url(worker)
    return (base[: -len("/metrics")] if base.endswith("/metrics") else base.rstrip("/")) + "/props"


async def scrape_once(session: aiohttp.ClientSession, url: str, engine: str, timeout_s: float,
                      now: Callable[[], float] = time.time) -> WorkerMetrics:
    """One scrape; raises on HTTP errors, timeouts and unparseable text."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.get(url, timeout=timeout) as resp:
        resp.raise_for_status()
        text = await resp.text()
    return parse_metrics(text, engine, now())


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
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        resp.raise_for_status()
        return parse_props(await resp.read())


class Scraper:
    """One scrape loop per worker of every pool, every ``interval_s`` (read at each round,
    so a change takes effect after the round in flight)."""

    def __init__(self, router: Router, *, interval_s: float = 0.25, timeout_s: float = 1.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.router = router
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.clock = clock
        self.scrapes: dict[str, int] = {}  # completed scrapes (good or failed) by worker
        self._slots: dict[str, Slots] = {}  # llama.cpp workers' /props, until a failure
        self._loops: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._session: aiohttp.ClientSession | None = None

    @property
    def rounds(self) -> int:
        """Scrapes completed by the least-scraped worker."""
        return min(self.scrapes.values(), default=0)

    def _session_(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def scrape_worker(self, pool: Pool, w: WorkerState) -> None:
        """Scrape one worker and store the result (or the failure) in its pool."""
        engine = w.labels.get("engine", "vllm")
        session = self._session_()
        try:
            m = await scrape_once(session, metrics_url(w), engine, self.timeout_s, self.clock)
            if engine == "llamacpp":
                m = await self._with_slots(session, w, m)
        except Exception as exc:  # any failure (refused, reset, timeout, parse) marks it down
            msg = f"{type(exc).__name__}: {exc}".strip(": ")
            if w.scrape_error != msg:
                log.warning("scrape of %s failed: %s", w.address, msg)
            self._slots.pop(w.address, None)  # read again once it is back (maybe restarted)
            pool.update_metrics(w.address, None, error=msg)
        else:
            if w.scrape_error is not None:
                log.info("scrape of %s works again", w.address)
            pool.update_metrics(w.address, m)
        self.scrapes[w.address] = self.scrapes.get(w.address, 0) + 1

    async def _with_slots(self, session: aiohttp.ClientSession, w: WorkerState,
                          m: WorkerMetrics) -> WorkerMetrics:
        old = w.metrics
        restarted = (old is not None and old.prefix_queries is not None
                     and m.prefix_queries is not None and m.prefix_queries < old.prefix_queries)
        if restarted or w.address not in self._slots:
            try:
                self._slots[w.address] = await fetch_slots(session, props_url(w), self.timeout_s)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                # Metrics without slots still route; /props is read again next round.
                log.warning("reading %s failed: %s", props_url(w), exc)
                return m
        slots, slot_tokens = self._slots[w.address]
        return replace(m, slots=slots, slot_tokens=slot_tokens)

    async def scrape_all(self) -> None:
        """Scrape every worker once, concurrently (tests; the loops use scrape_worker)."""
        await asyncio.gather(*(self.scrape_worker(p, w) for p in self.router.pools.values()
                               for w in list(p.workers.values())))

    async def _loop(self, pool_name: str, address: str) -> None:
        while True:
            pool = self.router.pools.get(pool_name)
            w = None if pool is None else pool.workers.get(address)
            if pool is None or w is None:
                return
            started = time.monotonic()
            await self.scrape_worker(pool, w)
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    def reconcile(self) -> None:
        """Start a loop for each new worker; forget loops whose worker is gone."""
        wanted = {(p.name, a) for p in self.router.pools.values() for a in p.workers}
        for key in wanted - self._loops.keys():
            self._loops[key] = asyncio.create_task(self._loop(*key))
        for key in [k for k, t in self._loops.items() if k not in wanted or t.done()]:
            if key not in wanted:
                self._loops.pop(key).cancel()
            elif self._loops[key].done():  # its worker vanished and came back
                self._loops[key] = asyncio.create_task(self._loop(*key))

    async def run(self) -> None:
        try:
            while True:
                self.reconcile()
                await asyncio.sleep(min(self.interval_s, 1.0))
        finally:
            for t in self._loops.values():
                t.cancel()
            await asyncio.gather(*self._loops.values(), return_exceptions=True)
            self._loops.clear()
            await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
