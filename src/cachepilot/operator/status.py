"""The CachePilotPool status subresource: workers, readiness, conditions, and their Events.

Why a periodic writer instead of a patch per change: worker metrics change on every scrape
(20 a second in tests, one a second in production), and a patch per scrape per replica
would load the API server for nothing. The leader alone writes, at most once per
``status_min_interval_s`` per pool and only when the status changed. Why problem Events are
raised here: the Ready condition is computed here, and a Warning is wanted when a pool
enters a problem state, not on every scrape while it stays there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp

from cachepilot.operator import crd
from cachepilot.operator.aio import wait_stopped
from cachepilot.operator.events import EventPoster
from cachepilot.operator.kube import ApiError, KubeClient, NotFound
from cachepilot.operator.options import OperatorOptions
from cachepilot.operator.state import PoolState, log, rfc3339

# Ready-condition reasons that are problems (Warning events when a pool enters one).
PROBLEM_REASONS = frozenset({"NoMatchingPods", "PortNotFound", "NoReadyWorkers",
                             "MetricsStale"})
STATUS_WORKERS_MAX = 50


class StatusWriter:
    """Builds each pool's status from this replica's view and patches it while leading."""

    def __init__(self, client: KubeClient | None, *, namespace: str, identity: str,
                 options: OperatorOptions, pools: Mapping[str, PoolState], events: EventPoster,
                 leading: Callable[[], bool], clock: Callable[[], float],
                 wall: Callable[[], float]) -> None:
        self.client = client
        self.namespace = namespace
        self.identity = identity
        self.options = options
        self.pools = pools
        self.events = events
        self.leading = leading
        self.clock = clock
        self.wall = wall

    def forget_written(self) -> None:
        """Write every pool's status at the next tick, whatever the last leader wrote."""
        for ps in self.pools.values():
            ps.last_status, ps.last_patch_at = None, float("-inf")

    def build_status(self, ps: PoolState) -> dict[str, Any]:
        """The status subresource for ``ps`` as this replica sees it now."""
        now, wall = self.clock(), self.wall()
        workers = []
        ready = stale = 0
        pool, cfg = ps.pool, ps.config
        for name in sorted(ps.members):
            m = ps.members[name]
            w = pool.workers.get(m.address) if pool is not None else None
            if w is None:
                continue
            age = w.metrics_age(now)
            is_stale = age is None or cfg is None or age > cfg.spec.cost.stale_after_s
            ready += m.ready
            stale += m.ready and is_stale
            line: dict[str, Any] = {"pod": m.pod, "address": m.address, "ready": m.ready,
                                    "stale": is_stale}
            if w.metrics is not None and age is not None:
                line.update(waiting=w.metrics.waiting, running=w.metrics.running,
                            lastScrape=rfc3339(wall - age))
                if w.metrics.kv_usage is not None:
                    line["kvUsage"] = round(w.metrics.kv_usage, 3)
            if w.scrape_error:
                line["scrapeError"] = w.scrape_error
            if m.kv_events is not None and pool is not None:
                # exact / degraded / approximate: how far its KV events are trusted
                line["directoryMode"] = pool.directory.mode(m.address) or "approximate"
            workers.append(line)

        valid = ("True", "Valid", "spec accepted") if ps.error is None else (
            "False", ps.error.reason, ps.error.message)
        fresh = ready - stale
        if cfg is None:
            assert ps.error is not None
            rd = ("False", ps.error.reason, f"invalid spec: {ps.error.message}")
        elif not ps.selected:
            whose = (f"InferencePool {cfg.inference_pool}'s selector" if cfg.inference_pool
                     else "the selector")
            rd = ("False", "NoMatchingPods", f"{whose} matches no pod in namespace "
                  f"{self.namespace}")
        elif not ps.members:
            rd = ("False", "PortNotFound",
                  "no selected pod has an IP and the configured port: "
                  + ", ".join(sorted(ps.unresolved)[:10]))
        elif ready == 0:
            rd = ("False", "NoReadyWorkers", f"none of {len(ps.members)} workers is ready")
        elif fresh == 0:
            rd = ("False", "MetricsStale",
                  f"no ready worker has metrics newer than {cfg.spec.cost.stale_after_s:g} s")
        else:
            rd = ("True", "WorkersReady", f"{fresh} of {len(ps.members)} workers ready with "
                  f"fresh metrics")
        conditions = [self._condition(ps, "Ready", *rd), self._condition(ps, "Valid", *valid)]
        return {
            "observedGeneration": ps.generation,
            "workers": len(ps.members),
            "readyWorkers": ready,
            "staleWorkers": stale,
            "writer": self.identity,
            "conditions": conditions,
            "workerStatus": workers[:STATUS_WORKERS_MAX],
        }

    def _condition(self, ps: PoolState, type_: str, status: str, reason: str,
                   message: str) -> dict[str, Any]:
        prev = ps.transitions.get(type_)
        if prev is None or prev[0] != status:
            prev = ps.transitions[type_] = (status, rfc3339(self.wall()))
        return {"type": type_, "status": status, "reason": reason, "message": message,
                "lastTransitionTime": prev[1], "observedGeneration": ps.generation}

    async def write_status(self, ps: PoolState) -> bool:
        """Patch ``ps``'s status if it changed and the rate limit allows; True if patched."""
        if self.client is None or not self.leading() or ps.kind != crd.KIND:
            return False  # InferencePools' status belongs to their gateways (inferencepool.py)
        status = self.build_status(ps)
        ready = status["conditions"][0]
        if ready["reason"] != ps.ready_reason:
            if ready["reason"] in PROBLEM_REASONS:
                self.events.emit(ps, "Warning", ready["reason"], ready["message"])
            elif ready["status"] == "True" and ps.ready_reason is not None:
                self.events.emit(ps, "Normal", "PoolReady", ready["message"])
            ps.ready_reason = ready["reason"]
        now = self.clock()
        if status == ps.last_status or now - ps.last_patch_at < self.options.status_min_interval_s:
            return False
        path = (f"/apis/{crd.GROUP}/{crd.VERSION}/namespaces/{self.namespace}/"
                f"{crd.PLURAL}/{ps.name}/status")
        try:
            await self.client.merge_patch(path, {"status": status})
        except NotFound:
            return False  # deleted meanwhile; its DELETED event is on the way
        ps.last_status, ps.last_patch_at = status, now
        return True

    async def run(self, stop: asyncio.Event) -> None:
        """Every ``status_tick_s`` until ``stop``, while leading: try each pool's status."""
        while not stop.is_set():
            if self.leading():
                for ps in list(self.pools.values()):
                    try:
                        await self.write_status(ps)
                    except (ApiError, aiohttp.ClientError, TimeoutError) as e:
                        log.warning("status of pool %s not written: %s", ps.name, e)
            await wait_stopped(stop, self.options.status_tick_s)
