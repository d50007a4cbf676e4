"""How to scrape each worker of the operator's pools, as the gateway's one Scraper asks it.

The scrape loop (:class:`cachepilot.datalayer.scrape.Scraper`) runs in the gateway for
static workers and Kubernetes pools alike and asks one function, ``(pool, worker) →
ScrapeTarget | None``, how to scrape each worker. In Kubernetes the answer is in the pool's
``spec.scrape`` (engine, interval, timeout, path and port) and the worker's pod (its IP, and
the scrape port when that is a named one), which only the operator knows:
:class:`ScrapeSources` is that function, reading the operator's live view. Why a lookup
rather than a loop of the operator's own: one loop means one schedule, one failure
behaviour and one set of engine adapters (llama.cpp's /props included) in both deployments.
"""

from __future__ import annotations

from collections.abc import Mapping

from cachepilot.core import Pool, WorkerState
from cachepilot.datalayer.scrape import ScrapeTarget, TargetsFor
from cachepilot.operator.state import PoolState


class ScrapeSources:
    """A ``TargetsFor`` over the operator's pools (bound by the Controller).

    A pool the operator does not own asks ``fallback`` (the Scraper's previous lookup); a
    worker of an operator pool without a resolved scrape URL is not scraped.
    """

    def __init__(self, fallback: TargetsFor | None = None) -> None:
        self.fallback = fallback
        self._pools: Mapping[str, PoolState] = {}

    def bind(self, pools: Mapping[str, PoolState]) -> None:
        self._pools = pools

    def __call__(self, pool: Pool, worker: WorkerState) -> ScrapeTarget | None:
        ps = self._pools.get(pool.name)
        if ps is None or ps.pool is not pool:
            return self.fallback(pool, worker) if self.fallback is not None else None
        url = ps.scrape_urls.get(worker.address)
        if ps.config is None or url is None:
            return None
        cfg = ps.config.scrape
        return ScrapeTarget(url, cfg.engine, cfg.interval_s, cfg.timeout_s)
