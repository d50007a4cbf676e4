"""Worker metrics into the router: one scrape loop per pool, plus a scrape on joining.

Why here and not in the gateway's own scraper loop: the operator knows each pool's members
and their scrape settings (URL, engine, interval, timeout) from the CRD and the pods, and
they change at any moment; the loop re-reads them every round. Why scrape a worker the
moment it joins: until its first scrape the router treats it as saturated, so a new pod
would get no requests for up to an interval.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

import aiohttp

from cachepilot.core import WorkerMetrics
from cachepilot.operator.state import Member, PoolState, log

# The scraper's contract (cachepilot.datalayer.scrape.scrape_once): raise on any failure.
ScrapeFn = Callable[[aiohttp.ClientSession, str, str, float, Callable[[], float]],
                    Awaitable[WorkerMetrics]]


class PoolScraper:
    """Scrapes pools' ready members and stores the metrics (or the error) in the router."""

    def __init__(self, scrape: ScrapeFn, session: aiohttp.ClientSession,
                 clock: Callable[[], float]) -> None:
        self.scrape = scrape
        self.session = session
        self.clock = clock
        self._side_tasks: set[asyncio.Task[None]] = set()

    def start(self, ps: PoolState) -> asyncio.Task[None]:
        """The pool's scrape loop, as a task; it ends when cancelled (the pool is dropped)."""
        return asyncio.create_task(self._loop(ps), name=f"scrape-{ps.name}")

    def scrape_soon(self, ps: PoolState, m: Member) -> None:
        """Scrape a worker that just became ready, without waiting for the pool's next round."""
        task = asyncio.create_task(self.scrape_member(ps, m))
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    async def scrape_member(self, ps: PoolState, m: Member) -> None:
        cfg, pool = ps.config, ps.pool
        if cfg is None or pool is None:
            return
        try:
            async with asyncio.timeout(cfg.scrape.timeout_s + 1.0):  # not wait_for: see aio
                metrics = await self.scrape(self.session, m.scrape_url, cfg.scrape.engine,
                                            cfg.scrape.timeout_s, self.clock)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # any failure is the worker's state, not the operator's
            text = str(e) or type(e).__name__
            pool.update_metrics(m.address, None, error=text[:200])
            return
        pool.update_metrics(m.address, metrics)

    async def scrape_pool_once(self, ps: PoolState) -> None:
        members = [m for m in ps.members.values() if m.ready]
        await asyncio.gather(*(self.scrape_member(ps, m) for m in members))

    async def _loop(self, ps: PoolState) -> None:
        while ps.config is not None:
            started = self.clock()
            try:
                await self.scrape_pool_once(ps)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("scraping pool %s", ps.name)
            await asyncio.sleep(max(0.0, ps.config.scrape.interval_s - (self.clock() - started)))

    async def close(self, pools: Iterable[PoolState]) -> None:
        """Cancel every pool's loop and every pending join scrape, and wait for them."""
        tasks = [ps.task for ps in pools if ps.task] + list(self._side_tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
