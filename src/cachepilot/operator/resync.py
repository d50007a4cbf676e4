"""Periodic relist of pools and pods, to forget what a watch gap hid being deleted.

Why: a 410 Gone relist or a watcher restart replays the objects that exist, never the ones
that vanished meanwhile, so without this a deleted pod could stay a worker forever. Objects
a watch event touched since the list began are left alone: the watch is fresher.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp

from cachepilot.operator import crd
from cachepilot.operator import inferencepool as ip
from cachepilot.operator.aio import wait_stopped
from cachepilot.operator.kube import ApiError, KubeClient
from cachepilot.operator.reconcile import Reconciler
from cachepilot.operator.state import log

Handler = Callable[[str | None, Mapping[str, Any]], Awaitable[None]]


async def resync(client: KubeClient, namespace: str, reconciler: Reconciler,
                 clock: Callable[[], float]) -> None:
    """List pools (and InferencePools, if watched) and pods and feed ``reconciler`` the
    deletions and additions it missed."""
    started = clock()
    base = f"/namespaces/{namespace}"
    pools = await client.get(f"/apis/{crd.GROUP}/{crd.VERSION}{base}/{crd.PLURAL}")
    cpools = {n: ps for n, ps in reconciler.pools.items() if ps.kind == crd.KIND}
    lists: list[tuple[str, list[Any], Mapping[str, Any], Handler]] = [
        ("pool", pools.get("items") or [], cpools, reconciler.on_pool_event)]
    if reconciler.epp_service is not None:
        infpools = await client.get(f"/apis/{ip.GROUP}/{ip.VERSION}{base}/{ip.PLURAL}")
        lists.append(("inferencepool", infpools.get("items") or [],
                      reconciler.inference_pools, reconciler.on_inference_pool_event))
    pods = await client.get(f"/api/v1{base}/pods")
    lists.append(("pod", pods.get("items") or [], reconciler.pods, reconciler.on_pod_event))
    seen_at = reconciler.seen_at
    for kind, items, cache, handler in lists:
        listed = {(i.get("metadata") or {}).get("name"): i for i in items}
        for name in list(cache):
            if name not in listed and seen_at.get((kind, name), 0.0) < started:
                log.info("resync: %s %s is gone", kind, name)
                await handler("DELETED", {"metadata": {"name": name}})
        for name, item in listed.items():
            if name not in cache and seen_at.get((kind, name), 0.0) < started:
                await handler(None, item)


async def resync_loop(stop: asyncio.Event, period_s: float,
                      resync_once: Callable[[], Awaitable[None]]) -> None:
    """Call ``resync_once`` every ``period_s`` until ``stop``; API trouble waits a round."""
    while not await wait_stopped(stop, period_s):
        try:
            await resync_once()
        except (ApiError, aiohttp.ClientError, TimeoutError) as e:
            log.warning("resync failed: %s", e)
