"""Fetch workers' metrics into the router's pools, each worker on its own schedule: the one
scrape loop, for static workers and Kubernetes pools alike.

Whoever owns a pool says how its workers are scraped, through a :data:`TargetsFor` lookup
(URL, engine, interval, timeout): :class:`StaticTargets` for the gateway's ``--workers``,
the operator's ``ScrapeSources`` (each CachePilotPool's ``spec.scrape`` and its pods) in
Kubernetes. The lookup is asked at every round, so a change takes effect after the round
in flight.

Each worker has its own loop, so a slow or hung worker delays only its own refresh, never the
others'. A failed scrape (refused, reset, timed out, unparseable) marks the worker down at once
(:meth:`cachepilot.core.pool.Pool.update_metrics`); the next good one brings it back. Only
workers declared ready are scraped (a pod that is not ready may not serve yet; static
workers always are). :meth:`Scraper.scrape_soon` scrapes a worker that just joined without
waiting: until its first scrape the router treats it as saturated.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from cachepilot.core.pool import Pool
from cachepilot.core.router import Router
from cachepilot.core.workers import WorkerState
from cachepilot.datalayer.engines import ScrapeFn, adapters, scrape_once

log = logging.getLogger("cachepilot.scrape")

ERROR_MAX_CHARS = 200  # the error lands in logs, /workers and the pool's status subresource
RECONCILE_MAX_S = 1.0  # new workers and pools are noticed within this, at most
RECONCILE_MIN_S = 0.05  # ...and looked for no more often (an interval of 0 must not spin)


@dataclass(frozen=True, slots=True)
class ScrapeTarget:
    """How to scrape one worker."""

    url: str  # its Prometheus metrics
    engine: str = "vllm"  # one of cachepilot.datalayer.engine_metrics.ENGINES
    interval_s: float = 0.25
    timeout_s: float = 1.0


# (pool, worker) → how to scrape it, or None: not scraped (yet).
TargetsFor = Callable[[Pool, WorkerState], ScrapeTarget | None]


class StaticTargets:
    """Static workers (``cachepilot gateway --workers``): the serving port's /metrics, the
    engine from the worker's ``engine`` label (``static_router`` sets it), one interval and
    timeout for all (read at each round: tests slow the loop down by changing them)."""

    def __init__(self, interval_s: float = 0.25, timeout_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.timeout_s = timeout_s

    def __call__(self, pool: Pool, w: WorkerState) -> ScrapeTarget:
        return ScrapeTarget(f"http://{w.address}/metrics", w.labels.get("engine", "vllm"),
                            self.interval_s, self.timeout_s)


def error_text(exc: BaseException) -> str:
    """``TimeoutError``, ``ClientConnectorError: Cannot connect …``: the type says what
    kind of failure it was even when the message is empty."""
    return f"{type(exc).__name__}: {exc}".strip(": ")[:ERROR_MAX_CHARS]


@dataclass(slots=True)
class _Loop:
    task: asyncio.Task[None]
    wake: asyncio.Event


class Scraper:
    """One scrape loop per ready worker of every pool of ``router``.

    ``targets`` may be replaced while running (the operator binds its pools' settings at
    start, keeping the previous lookup for pools it does not own).
    """

    def __init__(self, router: Router, targets: TargetsFor | None = None, *,
                 scrape: ScrapeFn = scrape_once, clock: Callable[[], float] = time.time) -> None:
        self.router = router
        self.targets: TargetsFor = targets or StaticTargets()
        self.clock = clock
        self.engines = adapters(scrape)
        self.scrapes: dict[str, int] = {}  # completed scrapes (good or failed) by worker
        # Called after every stored scrape (the gateway's flow control: a worker may have
        # room again, so held requests may go).
        self.on_update: Callable[[], None] = lambda: None
        self._loops: dict[tuple[str, str], _Loop] = {}
        self._session: aiohttp.ClientSession | None = None

    @property
    def rounds(self) -> int:
        """Scrapes completed by the least-scraped worker."""
        return min(self.scrapes.values(), default=0)

    def _session_(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    def target(self, pool: Pool, w: WorkerState) -> ScrapeTarget | None:
        """How to scrape ``w`` now, or None when it is not scraped."""
        return self.targets(pool, w) if w.declared_ready else None

    async def scrape_worker(self, pool: Pool, w: WorkerState,
                            target: ScrapeTarget | None = None) -> None:
        """Scrape one worker and store the result (or the failure) in its pool."""
        target = target or self.target(pool, w)
        if target is None:
            return
        engine = self.engines.get(target.engine)
        try:
            if engine is None:
                raise ValueError(f"unknown engine {target.engine!r}; "
                                 f"known: {', '.join(self.engines)}")
            m = await engine.scrape(self._session_(), w, target.url, target.timeout_s,
                                    self.clock)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure (refused, reset, timeout, parse) marks it down
            msg = error_text(exc)
            if w.scrape_error != msg:
                log.warning("scrape of %s failed: %s", w.address, msg)
            if engine is not None:
                engine.forget(w.address)
            pool.update_metrics(w.address, None, error=msg)
        else:
            if w.scrape_error is not None:
                log.info("scrape of %s works again", w.address)
            pool.update_metrics(w.address, m)
        self.scrapes[w.address] = self.scrapes.get(w.address, 0) + 1
        self.on_update()

    async def scrape_all(self) -> None:
        """Scrape every scraped worker once, concurrently (tests; the loops use scrape_worker)."""
        await asyncio.gather(*(self.scrape_worker(p, w) for p in self.router.pools.values()
                               for w in list(p.workers.values())))

    def _find(self, pool_name: str, address: str
              ) -> tuple[Pool, WorkerState, ScrapeTarget] | None:
        pool = self.router.pools.get(pool_name)
        w = None if pool is None else pool.workers.get(address)
        if pool is None or w is None:
            return None
        target = self.target(pool, w)
        return None if target is None else (pool, w, target)

    async def _loop(self, pool_name: str, address: str, wake: asyncio.Event) -> None:
        while (found := self._find(pool_name, address)) is not None:
            pool, w, target = found
            wake.clear()  # a scrape_soon from now on means "again, after this one"
            started = time.monotonic()
            await self.scrape_worker(pool, w, target)
            # The interval as it is now: a change made during the scrape applies at once.
            if (found := self._find(pool_name, address)) is None:
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(found[2].interval_s - (time.monotonic() - started)):
                    await wake.wait()

    def _start(self, key: tuple[str, str]) -> None:
        wake = asyncio.Event()
        self._loops[key] = _Loop(asyncio.create_task(self._loop(*key, wake)), wake)

    def scrape_soon(self, pool: str, address: str) -> None:
        """Scrape this worker now (it just joined or became ready), then on its schedule."""
        loop = self._loops.get((pool, address))
        if loop is None or loop.task.done():
            self._start((pool, address))
        else:
            loop.wake.set()

    def reconcile(self) -> float:
        """Start a loop for each new worker, forget those of workers gone or not scraped;
        returns the shortest interval of any worker."""
        wanted: dict[tuple[str, str], float] = {}
        addresses: set[str] = set()
        for p in self.router.pools.values():
            for a, w in p.workers.items():
                addresses.add(a)
                target = self.target(p, w)
                if target is not None:
                    wanted[p.name, a] = target.interval_s
        for key in [k for k in self._loops if k not in wanted]:
            self._loops.pop(key).task.cancel()
        for address in [a for a in self.scrapes if a not in addresses]:  # left every pool
            del self.scrapes[address]
            for engine in self.engines.values():
                engine.forget(address)
        for key in wanted:
            if key not in self._loops or self._loops[key].task.done():
                self._start(key)  # new, or its worker vanished and came back
        return min(wanted.values(), default=RECONCILE_MAX_S)

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(min(max(self.reconcile(), RECONCILE_MIN_S),
                                        RECONCILE_MAX_S))
        finally:
            await self.close()

    async def close(self) -> None:
        """Stop every worker's loop and close the HTTP session."""
        loops, self._loops = list(self._loops.values()), {}
        for loop in loops:
            loop.task.cancel()
        await asyncio.gather(*(loop.task for loop in loops), return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None
