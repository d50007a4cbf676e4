"""Kubernetes Events about pools (WorkerJoined, WorkerLeft, PoolReady, problems).

Why a queue and a task of their own: an Event is raised in the middle of routing-critical
work (a pod turning not-ready), and posting it is an API call that may be slow or failing.
:meth:`EventPoster.emit` only enqueues (dropping when full), so routing never waits for the
API server; :meth:`EventPoster.run` posts in the background.

Why only the leader posts: every replica sees the same pods change, so N replicas would post
every Event N times. Events raised before the first election round are held, then posted if
this replica won; otherwise the workers found at startup would never get their WorkerJoined.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp

from cachepilot.operator.kube import ApiError, Conflict, KubeClient
from cachepilot.operator.state import PoolState, log, rfc3339


class EventPoster:
    """Queues Events about pools and posts them while ``leading()`` says we hold the Lease."""

    def __init__(self, client: KubeClient | None, *, namespace: str, identity: str,
                 leading: Callable[[], bool], wall: Callable[[], float], max_queued: int,
                 hold_until_elected: bool) -> None:
        self.client = client
        self.namespace = namespace
        self.identity = identity
        self.leading = leading
        self.wall = wall
        self.max_queued = max_queued
        self._held: list[dict[str, Any]] | None = [] if hold_until_elected else None
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(max_queued)

    def leadership_changed(self, leader: bool) -> None:
        """The first election round is over: post what was held if we won, else drop it."""
        held, self._held = self._held, None
        for event in held or []:
            if leader:
                with contextlib.suppress(asyncio.QueueFull):
                    self._queue.put_nowait(event)

    def emit(self, ps: PoolState, type_: str, reason: str, message: str) -> None:
        """Queue an Event about pool ``ps`` (only the leader posts; others would duplicate)."""
        log.info("pool %s: %s %s: %s", ps.name, type_, reason, message)
        if self.client is None or (not self.leading() and self._held is None):
            return
        now = self.wall()
        stamp = rfc3339(now)
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{ps.body_ref['name']}.{uuid.uuid4().hex[:16]}",
                         "namespace": self.namespace},
            "involvedObject": dict(ps.body_ref),
            "type": type_, "reason": reason, "message": message[:1024],
            "source": {"component": "cachepilot-gateway"},
            "reportingComponent": "cachepilot.io/gateway",
            "reportingInstance": self.identity,
            "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
        }
        if self._held is not None:
            if len(self._held) < self.max_queued:
                self._held.append(event)
            return
        with contextlib.suppress(asyncio.QueueFull):  # never block routing on Events
            self._queue.put_nowait(event)

    async def run(self, stop: asyncio.Event) -> None:
        """Post queued Events one at a time until ``stop``; a failed post is logged, not
        retried here (the client already retried with backoff)."""
        path = f"/api/v1/namespaces/{self.namespace}/events"
        while not stop.is_set():
            getter = asyncio.ensure_future(self._queue.get())
            stopper = asyncio.ensure_future(stop.wait())
            done, _ = await asyncio.wait({getter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                stopper.cancel()
                return
            stopper.cancel()
            assert self.client is not None
            try:
                await self.client.create(path, getter.result())
            except Conflict:
                pass  # a retry after a 5xx that had in fact stored it: posted once, fine
            except (ApiError, aiohttp.ClientError, TimeoutError) as e:
                log.warning("event not posted: %s", e)
