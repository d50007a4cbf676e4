"""Fetch workers' Prometheus metrics into the router's pools, on a fixed interval.

A failed or slow scrape keeps the old snapshot, which ages into staleness: the router then
treats the worker as saturated (cachepilot.core.cost.effective_load), never as idle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from cachepilot.core.router import Router
from cachepilot.core.workers import WorkerMetrics, WorkerState
from cachepilot.gateway.engine_metrics import parse_metrics

log = logging.getLogger("cachepilot.scrape")


def metrics_url(worker: WorkerState) -> str:
    """``labels['metrics_url']`` when the operator set one, else the serving port's /metrics."""
    return worker.labels.get("metrics_url") or f"http://{worker.address}/metrics"


async def scrape_once(session: aiohttp.ClientSession, url: str, engine: str, timeout_s: float,
                      now: Callable[[], float] = time.time) -> WorkerMetrics:
    """One scrape; raises on HTTP errors, timeouts and unparseable text."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.get(url, timeout=timeout) as resp:
        resp.raise_for_status()
        text = await resp.text()
    return parse_metrics(text, engine, now())


class Scraper:
    """Scrapes every worker of every pool each ``interval_s``."""

    def __init__(self, router: Router, *, interval_s: float = 0.25, timeout_s: float = 1.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.router = router
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.clock = clock
        self.rounds = 0
        self._session: aiohttp.ClientSession | None = None

    async def scrape_all(self) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        jobs = [(pool, w) for pool in self.router.pools.values() for w in pool.workers.values()]
        results = await asyncio.gather(
            *(scrape_once(self._session, metrics_url(w), w.labels.get("engine", "vllm"),
                          self.timeout_s, self.clock) for _, w in jobs),
            return_exceptions=True)
        for (pool, w), res in zip(jobs, results, strict=True):
            if isinstance(res, BaseException):
                msg = f"{type(res).__name__}: {res}".strip(": ")
                if w.scrape_error != msg:
                    log.warning("scrape of %s failed: %s", w.address, msg)
                pool.update_metrics(w.address, None, error=msg)
            else:
                pool.update_metrics(w.address, res)
        self.rounds += 1

    async def run(self) -> None:
        try:
            while True:
                started = time.monotonic()
                await self.scrape_all()
                await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))
        finally:
            await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
