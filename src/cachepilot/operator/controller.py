"""The operator's state machine: CachePilotPools and Pods in, the router's pools out.

kopf delivers watch events to :meth:`Controller.on_pool_event` and
:meth:`Controller.on_pod_event`; both are coroutines on the gateway's event loop, so they
mutate the :class:`~cachepilot.core.Router` with no lock and no thread hop (a sync kopf
handler would run in a thread pool and race the ext_proc server). The effect is immediate:
the request after a pod turns not-ready is already routed without it.

Three loops run beside the handlers: one scraper per pool (metrics → router, at the pool's
interval), one status writer and one Event poster. The last two act only while this replica
holds the Lease, so N gateway replicas write status once, not N times, and at a bounded rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from cachepilot.core import Pool, Router, WorkerMetrics
from cachepilot.operator import crd
from cachepilot.operator.aio import wait_stopped
from cachepilot.operator.kube import ApiError, Conflict, KubeClient, NotFound
from cachepilot.operator.spec import (
    InvalidSpec,
    PodView,
    PoolConfig,
    host_port,
    parse_pool,
    pod_view,
    resolve_port,
)

log = logging.getLogger(__name__)

# The scraper's contract (cachepilot.gateway.scrape.scrape_once): raise on any failure.
ScrapeFn = Callable[[aiohttp.ClientSession, str, str, float, Callable[[], float]],
                    Awaitable[WorkerMetrics]]

# Ready-condition reasons that are problems (Warning events when a pool enters one).
PROBLEM_REASONS = frozenset({"NoMatchingPods", "PortNotFound", "NoReadyWorkers",
                             "MetricsStale"})
STATUS_WORKERS_MAX = 50


class EventSink(Protocol):
    def __call__(self, pool: PoolState, type_: str, reason: str, message: str) -> None: ...


@dataclass(frozen=True, slots=True)
class OperatorOptions:
    """Knobs with production defaults; tests shrink the periods."""

    status_min_interval_s: float = 5.0  # at most one status patch per pool per this
    status_tick_s: float = 1.0
    lease_name: str = "cachepilot-gateway"
    lease_duration_s: float = 15.0
    lease_renew_deadline_s: float = 10.0
    lease_retry_period_s: float = 2.0
    elect_leader: bool = True  # False: this replica always writes (single-replica installs)
    api_backoffs: tuple[float, ...] = (0.5, 1, 2, 4, 8)  # our writes (status, events, lease)
    watch_error_backoffs: tuple[float, ...] = (1, 1, 2, 3, 5, 8, 13, 21)  # kopf's watches
    max_events_queued: int = 1000
    # Relist pods and pools this often (and after every watcher restart) to catch deletions
    # a watch gap hid (410 Gone relists and restarts replay what exists, not what vanished).
    resync_period_s: float = 60.0
    # The watcher (kopf) is restarted with these delays if it dies (e.g. API down too long).
    restart_backoffs: tuple[float, ...] = (1, 2, 5, 10, 30)


@dataclass(slots=True)
class Member:
    """A selected pod with an address: a worker of the pool (ready or not)."""

    pod: str
    address: str
    scrape_url: str
    ready: bool


@dataclass(slots=True)
class PoolState:
    name: str
    uid: str
    body_ref: dict[str, str]  # for Events' involvedObject
    generation: int = 0
    config: PoolConfig | None = None  # last valid spec (kept while a newer one is invalid)
    error: InvalidSpec | None = None  # the newest spec's problem, if any
    pool: Pool | None = None  # the router's pool, once a valid spec was seen
    members: dict[str, Member] = field(default_factory=dict)  # pod name → member
    selected: set[str] = field(default_factory=set)  # pods the selector matches
    unresolved: set[str] = field(default_factory=set)  # selected, but no port/IP yet
    task: asyncio.Task[None] | None = None
    last_status: dict[str, Any] | None = None
    last_patch_at: float = float("-inf")
    transitions: dict[str, tuple[str, str]] = field(default_factory=dict)  # type → (st, time)
    ready_reason: str | None = None
    warned_generation: int | None = None


def rfc3339(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Controller:
    def __init__(self, router: Router, *, namespace: str, scrape: ScrapeFn,
                 session: aiohttp.ClientSession, client: KubeClient | None,
                 identity: str, options: OperatorOptions,
                 clock: Callable[[], float] = time.time,
                 wall: Callable[[], float] = time.time) -> None:
        self.router = router
        self.namespace = namespace
        self.scrape = scrape
        self.session = session
        self.client = client
        self.identity = identity
        self.options = options
        self.clock = clock
        self.wall = wall
        self.pods: dict[str, PodView] = {}
        self.pools: dict[str, PoolState] = {}
        self.is_leader = not options.elect_leader
        # Events from before the first election round are held, then posted if we won:
        # otherwise workers found at startup would never get their WorkerJoined.
        self._held: list[dict[str, Any]] | None = [] if options.elect_leader else None
        self._events: asyncio.Queue[dict[str, Any]] = asyncio.Queue(options.max_events_queued)
        self._side_tasks: set[asyncio.Task[None]] = set()
        self._seen_at: dict[tuple[str, str], float] = {}  # (kind, name) → last watch event

    # ---- leadership --------------------------------------------------------------------

    def set_leader(self, leader: bool) -> None:
        self.is_leader = leader
        held, self._held = self._held, None
        for event in held or []:
            if leader:
                with contextlib.suppress(asyncio.QueueFull):
                    self._events.put_nowait(event)
        if leader:  # write every pool's status at once, whatever the last leader wrote
            for ps in self.pools.values():
                ps.last_status, ps.last_patch_at = None, float("-inf")

    # ---- kopf entry points ---------------------------------------------------------------

    async def on_pool_event(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        name, uid = meta.get("name", ""), meta.get("uid", "")
        self._seen_at["pool", name] = self.clock()
        ps = self.pools.get(name)
        if event_type == "DELETED":
            if ps is not None and (not uid or not ps.uid or ps.uid == uid):
                self._drop_pool(ps)
            return
        if ps is not None and uid and ps.uid and ps.uid != uid:  # recreated under our feet
            self._drop_pool(ps)
            ps = None
        if ps is None:
            ps = self.pools[name] = PoolState(
                name=name, uid=uid,
                body_ref={"apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": name,
                          "namespace": self.namespace, "uid": uid})
        ps.generation = int(meta.get("generation") or 0)
        try:
            config = parse_pool(name, body)
        except InvalidSpec as e:
            ps.error = e
            if ps.warned_generation != ps.generation:
                ps.warned_generation = ps.generation
                kept = " (still routing with the previous valid spec)" if ps.config else ""
                self.emit(ps, "Warning", e.reason, f"{e.message}{kept}")
            log.warning("pool %s is invalid: %s: %s", name, e.reason, e.message)
            return
        ps.error = None
        if ps.config is not None and ps.config == config:
            return  # a status-only or metadata-only change
        ps.config = config
        if ps.pool is None:
            ps.pool = Pool(config.spec)
            self.router.add_pool(ps.pool)
        else:
            ps.pool.reconfigure(config.spec)
        self._sync_all_pods(ps)
        if ps.task is None:
            ps.task = asyncio.create_task(self._scrape_loop(ps), name=f"scrape-{name}")

    async def on_pod_event(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        name = (body.get("metadata") or {}).get("name", "")
        self._seen_at["pod", name] = self.clock()
        if event_type == "DELETED":
            self.pods.pop(name, None)
        else:
            self.pods[name] = pod_view(body)
        for ps in self.pools.values():
            self._sync_pod(ps, name)

    async def resync(self) -> None:
        """List pools and pods and forget what the watches missed being deleted. Objects a
        watch event touched since the list began are left alone: the watch is fresher."""
        if self.client is None:
            return
        started = self.clock()
        base = f"/namespaces/{self.namespace}"
        pools = await self.client.get(f"/apis/{crd.GROUP}/{crd.VERSION}{base}/{crd.PLURAL}")
        pods = await self.client.get(f"/api/v1{base}/pods")
        for kind, items, cache, handler in (
                ("pool", pools.get("items") or [], self.pools, self.on_pool_event),
                ("pod", pods.get("items") or [], self.pods, self.on_pod_event)):
            listed = {(i.get("metadata") or {}).get("name"): i for i in items}
            for name in list(cache):
                if name not in listed and self._seen_at.get((kind, name), 0.0) < started:
                    log.info("resync: %s %s is gone", kind, name)
                    await handler("DELETED", {"metadata": {"name": name}})
            for name, item in listed.items():
                if name not in cache and self._seen_at.get((kind, name), 0.0) < started:
                    await handler(None, item)

    async def resync_loop(self, stop: asyncio.Event) -> None:
        while not await wait_stopped(stop, self.options.resync_period_s):
            try:
                await self.resync()
            except (ApiError, aiohttp.ClientError, TimeoutError) as e:
                log.warning("resync failed: %s", e)

    # ---- membership ----------------------------------------------------------------------

    def _drop_pool(self, ps: PoolState) -> None:
        if ps.task is not None:
            ps.task.cancel()
        if ps.pool is not None and self.router.pools.get(ps.name) is ps.pool:
            self.router.remove_pool(ps.name)
        self.pools.pop(ps.name, None)
        log.info("pool %s removed with %d workers", ps.name, len(ps.members))

    def _sync_all_pods(self, ps: PoolState) -> None:
        for name in sorted(set(self.pods) | set(ps.members) | ps.selected):
            self._sync_pod(ps, name)

    def _desired(self, ps: PoolState, pod: PodView | None) -> Member | None:
        cfg = ps.config
        if cfg is None or pod is None or not cfg.selector.matches(pod.labels):
            ps.selected.discard(pod.name if pod else "")
            return None
        ps.selected.add(pod.name)
        port = resolve_port(cfg.port, pod)
        scrape_port = port if cfg.scrape.port is None else resolve_port(cfg.scrape.port, pod)
        if pod.ip is None or port is None or scrape_port is None:
            ps.unresolved.add(pod.name)
            return None
        ps.unresolved.discard(pod.name)
        return Member(pod=pod.name, address=host_port(pod.ip, port),
                      scrape_url=f"http://{host_port(pod.ip, scrape_port)}{cfg.scrape.path}",
                      ready=pod.ready)

    def _sync_pod(self, ps: PoolState, name: str) -> None:
        """Make pool ``ps`` agree with pod ``name``: add, update readiness, or remove."""
        if ps.pool is None:
            return
        pod = self.pods.get(name)
        if pod is None:
            ps.selected.discard(name)
            ps.unresolved.discard(name)
        want = self._desired(ps, pod)
        have = ps.members.get(name)
        if have is not None and (want is None or want.address != have.address):
            ps.pool.remove_worker(have.address)
            del ps.members[name]
            if have.ready:
                why = "deleted" if pod is None else "no longer selected"
                self.emit(ps, "Normal", "WorkerLeft", f"pod {name} ({have.address}) {why}")
            have = None
        if want is None:
            return
        labels = dict(pod.labels) if pod is not None else {}
        if have is None:
            ps.pool.upsert_worker(want.address, ready=want.ready, labels=labels)
            ps.members[name] = want
            if want.ready:
                self._joined(ps, want)
        elif have.ready != want.ready:
            ps.pool.set_ready(want.address, want.ready)
            have.ready = want.ready
            if want.ready:
                self._joined(ps, have)
            else:
                state = "terminating" if pod is not None and pod.terminating else "not ready"
                self.emit(ps, "Normal", "WorkerLeft", f"pod {name} ({have.address}) is {state}")

    def _joined(self, ps: PoolState, m: Member) -> None:
        self.emit(ps, "Normal", "WorkerJoined", f"pod {m.pod} ({m.address}) is ready")
        # Scrape it now: until its first scrape the router treats it as saturated.
        task = asyncio.create_task(self._scrape_member(ps, m))
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    # ---- scraping ------------------------------------------------------------------------

    async def _scrape_member(self, ps: PoolState, m: Member) -> None:
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
        await asyncio.gather(*(self._scrape_member(ps, m) for m in members))

    async def _scrape_loop(self, ps: PoolState) -> None:
        while ps.config is not None:
            started = self.clock()
            try:
                await self.scrape_pool_once(ps)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("scraping pool %s", ps.name)
            await asyncio.sleep(max(0.0, ps.config.scrape.interval_s - (self.clock() - started)))

    # ---- status --------------------------------------------------------------------------

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
            line: dict[str, Any] = {"pod": name, "address": m.address, "ready": m.ready,
                                    "stale": is_stale}
            if w.metrics is not None and age is not None:
                line.update(waiting=w.metrics.waiting, running=w.metrics.running,
                            lastScrape=rfc3339(wall - age))
                if w.metrics.kv_usage is not None:
                    line["kvUsage"] = round(w.metrics.kv_usage, 3)
            if w.scrape_error:
                line["scrapeError"] = w.scrape_error
            workers.append(line)

        valid = ("True", "Valid", "spec accepted") if ps.error is None else (
            "False", ps.error.reason, ps.error.message)
        fresh = ready - stale
        if cfg is None:
            assert ps.error is not None
            rd = ("False", ps.error.reason, f"invalid spec: {ps.error.message}")
        elif not ps.selected:
            rd = ("False", "NoMatchingPods", "the selector matches no pod in namespace "
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
        if self.client is None or not self.is_leader:
            return False
        status = self.build_status(ps)
        ready = status["conditions"][0]
        if ready["reason"] != ps.ready_reason:
            if ready["reason"] in PROBLEM_REASONS:
                self.emit(ps, "Warning", ready["reason"], ready["message"])
            elif ready["status"] == "True" and ps.ready_reason is not None:
                self.emit(ps, "Normal", "PoolReady", ready["message"])
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

    async def status_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if self.is_leader:
                for ps in list(self.pools.values()):
                    try:
                        await self.write_status(ps)
                    except (ApiError, aiohttp.ClientError, TimeoutError) as e:
                        log.warning("status of pool %s not written: %s", ps.name, e)
            await wait_stopped(stop, self.options.status_tick_s)

    # ---- Kubernetes Events ---------------------------------------------------------------

    def emit(self, ps: PoolState, type_: str, reason: str, message: str) -> None:
        """Queue an Event about pool ``ps`` (only the leader posts; others would duplicate)."""
        log.info("pool %s: %s %s: %s", ps.name, type_, reason, message)
        if self.client is None or (not self.is_leader and self._held is None):
            return
        now = self.wall()
        stamp = rfc3339(now)
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{ps.name}.{uuid.uuid4().hex[:16]}",
                         "namespace": self.namespace},
            "involvedObject": dict(ps.body_ref),
            "type": type_, "reason": reason, "message": message[:1024],
            "source": {"component": "cachepilot-gateway"},
            "reportingComponent": "cachepilot.io/gateway",
            "reportingInstance": self.identity,
            "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
        }
        if self._held is not None:
            if len(self._held) < self.options.max_events_queued:
                self._held.append(event)
            return
        with contextlib.suppress(asyncio.QueueFull):  # never block routing on Events
            self._events.put_nowait(event)

    async def event_loop(self, stop: asyncio.Event) -> None:
        path = f"/api/v1/namespaces/{self.namespace}/events"
        while not stop.is_set():
            getter = asyncio.ensure_future(self._events.get())
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

    # ---- shutdown ------------------------------------------------------------------------

    async def close(self) -> None:
        tasks = [ps.task for ps in self.pools.values() if ps.task] + list(self._side_tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
