"""The operator's state machine, assembled: CachePilotPools and Pods in, the router's pools out.

Why a facade over small parts: :mod:`cachepilot.operator.runner` wires one object into kopf
and the gateway's task group, while each concern lives in its own module:

- :mod:`~cachepilot.operator.reconcile`: watch events → the router's pools and workers;
- :mod:`~cachepilot.operator.scrape_sources`: each pool's scrape settings, for the gateway's
  one scrape loop (:class:`cachepilot.datalayer.scrape.Scraper`);
- :mod:`~cachepilot.operator.status`: the status subresource, rate-limited;
- :mod:`~cachepilot.operator.events`: Kubernetes Events, posted in the background;
- :mod:`~cachepilot.operator.resync`: the periodic relist that catches missed deletions.

Status and Events are written only while this replica holds the Lease (:meth:`set_leader`),
so N gateway replicas write them once, not N times, and at a bounded rate.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

from cachepilot.core import Router
from cachepilot.datalayer.scrape import Scraper
from cachepilot.operator import resync as relist
from cachepilot.operator.events import EventPoster
from cachepilot.operator.kube import KubeClient
from cachepilot.operator.kv_sources import KVEventSources
from cachepilot.operator.objectives import Objectives
from cachepilot.operator.options import OperatorOptions
from cachepilot.operator.pods import PodView
from cachepilot.operator.reconcile import Reconciler
from cachepilot.operator.scrape_sources import ScrapeSources
from cachepilot.operator.state import Member, PoolState, rfc3339
from cachepilot.operator.status import PROBLEM_REASONS, STATUS_WORKERS_MAX, StatusWriter

__all__ = ["PROBLEM_REASONS", "STATUS_WORKERS_MAX", "Controller", "KVEventSources", "Member",
           "OperatorOptions", "PoolState", "ScrapeSources", "rfc3339"]


class Controller:
    """One replica's operator: the parts above sharing one view of pools, pods and the Lease."""

    def __init__(self, router: Router, *, namespace: str, scraper: Scraper | None,
                 client: KubeClient | None, identity: str, options: OperatorOptions,
                 clock: Callable[[], float] = time.time,
                 wall: Callable[[], float] = time.time,
                 kv_events: KVEventSources | None = None,
                 objectives: MutableMapping[str, int] | None = None) -> None:
        self.router = router
        self.namespace = namespace
        self.client = client
        self.identity = identity
        self.options = options
        self.clock = clock
        self.wall = wall
        self.is_leader = not options.elect_leader
        leading = lambda: self.is_leader  # noqa: E731  (read at each use, never cached)
        self.events = EventPoster(client, namespace=namespace, identity=identity,
                                  leading=leading, wall=wall,
                                  max_queued=options.max_events_queued,
                                  hold_until_elected=options.elect_leader)
        self.reconciler = Reconciler(router, namespace=namespace, events=self.events,
                                     clock=clock, epp_service=options.epp_service,
                                     scrape_soon=scraper.scrape_soon if scraper else None)
        # The gateway's Scraper asks this how to scrape our pools' workers (scrape_sources.py).
        self.scrape_sources = ScrapeSources(fallback=scraper.targets if scraper else None)
        self.scrape_sources.bind(self.reconciler.pools)
        if scraper is not None:
            scraper.targets = self.scrape_sources
        # The gateway's KV-event hub asks this where each worker publishes (kv_sources.py).
        self.kv_events = kv_events or KVEventSources()
        self.kv_events.bind(self.reconciler.pools)
        # InferenceObjective name → priority, for the gateway's flow control (objectives.py).
        self.objectives = Objectives(objectives if objectives is not None else {})
        self.status = StatusWriter(client, namespace=namespace, identity=identity,
                                   options=options, pools=self.reconciler.pools,
                                   events=self.events, leading=leading, clock=clock, wall=wall)

    @property
    def pools(self) -> dict[str, PoolState]:
        return self.reconciler.pools

    @property
    def pods(self) -> dict[str, PodView]:
        return self.reconciler.pods

    def set_leader(self, leader: bool) -> None:
        """The Lease elector's callback: start or stop writing status and Events."""
        self.is_leader = leader
        self.events.leadership_changed(leader)
        if leader:  # write every pool's status at once, whatever the last leader wrote
            self.status.forget_written()

    # ---- kopf entry points and the relist ------------------------------------------------

    async def on_pool_event(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        await self.reconciler.on_pool_event(event_type, body)

    async def on_pod_event(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        await self.reconciler.on_pod_event(event_type, body)

    async def on_inference_pool_event(self, event_type: str | None,
                                      body: Mapping[str, Any]) -> None:
        await self.reconciler.on_inference_pool_event(event_type, body)

    async def on_objective_event(self, event_type: str | None,
                                 body: Mapping[str, Any]) -> None:
        await self.objectives.on_event(event_type, body)

    async def resync(self) -> None:
        """List pools and pods and forget what the watches missed being deleted."""
        if self.client is None:
            return
        await relist.resync(self.client, self.namespace, self.reconciler, self.clock)

    async def resync_loop(self, stop: asyncio.Event) -> None:
        await relist.resync_loop(stop, self.options.resync_period_s, self.resync)

    # ---- the loops the runner starts beside kopf -----------------------------------------

    async def status_loop(self, stop: asyncio.Event) -> None:
        await self.status.run(stop)

    async def event_loop(self, stop: asyncio.Event) -> None:
        await self.events.run(stop)

    # ---- single steps, for callers that drive the parts by hand --------------------------

    def emit(self, ps: PoolState, type_: str, reason: str, message: str) -> None:
        self.events.emit(ps, type_, reason, message)

    def build_status(self, ps: PoolState) -> dict[str, Any]:
        return self.status.build_status(ps)

    async def write_status(self, ps: PoolState) -> bool:
        return await self.status.write_status(ps)

