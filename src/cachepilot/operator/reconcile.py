"""CachePilotPools and Pods in, the router's pools and workers out.

kopf delivers watch events to :meth:`Reconciler.on_pool_event` and
:meth:`Reconciler.on_pod_event`; both are coroutines on the gateway's event loop, so they
mutate the :class:`~cachepilot.core.Router` with no lock and no thread hop (a sync kopf
handler would run in a thread pool and race the ext_proc server). The effect is immediate:
the request after a pod turns not-ready is already routed without it.

Why each pod is re-derived from scratch (:meth:`Reconciler._sync_pod`) rather than patched
by event type: a watch may skip events (410 Gone, restarts, resyncs replay objects), so the
only safe rule is "make the pool agree with what the pod looks like now".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from cachepilot.core import Pool, Router
from cachepilot.operator import crd
from cachepilot.operator.events import EventPoster
from cachepilot.operator.scraping import PoolScraper
from cachepilot.operator.spec import (
    InvalidSpec,
    PodView,
    host_port,
    parse_pool,
    pod_view,
    resolve_port,
)
from cachepilot.operator.state import Member, PoolState, log


class Reconciler:
    """Keeps the router's pools, and each pool's workers, in step with the watched objects."""

    def __init__(self, router: Router, *, namespace: str, events: EventPoster,
                 scraper: PoolScraper, clock: Callable[[], float]) -> None:
        self.router = router
        self.namespace = namespace
        self.events = events
        self.scraper = scraper
        self.clock = clock
        self.pods: dict[str, PodView] = {}
        self.pools: dict[str, PoolState] = {}
        # (kind, name) → when a watch event last touched it: resync must not undo fresher news.
        self.seen_at: dict[tuple[str, str], float] = {}

    async def on_pool_event(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        name, uid = meta.get("name", ""), meta.get("uid", "")
        self.seen_at["pool", name] = self.clock()
        ps = self.pools.get(name)
        if event_type == "DELETED":
            if ps is not None and (not uid or not ps.uid or ps.uid == uid):
                self.drop_pool(ps)
            return
        if ps is not None and uid and ps.uid and ps.uid != uid:  # recreated under our feet
            self.drop_pool(ps)
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
                self.events.emit(ps, "Warning", e.reason, f"{e.message}{kept}")
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
            ps.task = self.scraper.start(ps)

    async def on_pod_event(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        name = (body.get("metadata") or {}).get("name", "")
        self.seen_at["pod", name] = self.clock()
        if event_type == "DELETED":
            self.pods.pop(name, None)
        else:
            self.pods[name] = pod_view(body)
        for ps in self.pools.values():
            self._sync_pod(ps, name)

    def drop_pool(self, ps: PoolState) -> None:
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
                self.events.emit(ps, "Normal", "WorkerLeft",
                                 f"pod {name} ({have.address}) {why}")
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
                self.events.emit(ps, "Normal", "WorkerLeft",
                                 f"pod {name} ({have.address}) is {state}")

    def _joined(self, ps: PoolState, m: Member) -> None:
        self.events.emit(ps, "Normal", "WorkerJoined", f"pod {m.pod} ({m.address}) is ready")
        # Scrape it now: until its first scrape the router treats it as saturated.
        self.scraper.scrape_soon(ps, m)
