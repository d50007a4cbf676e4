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
from cachepilot.datalayer.model_files import ModelFilesError, load_prompts, parse_lora_modules
from cachepilot.operator import crd
from cachepilot.operator import inferencepool as ip
from cachepilot.operator.events import EventPoster
from cachepilot.operator.pods import PodView, host_port, pod_view, resolve_port
from cachepilot.operator.spec import InvalidSpec, PoolConfig, kv_event_endpoints, parse_pool
from cachepilot.operator.state import Member, PoolState, log


class Reconciler:
    """Keeps the router's pools, and each pool's workers, in step with the watched objects.

    ``epp_service``: the Service name an InferencePool's ``endpointPickerRef`` must give for
    the InferencePool to become a pool here (``None``: InferencePools make no pools of their
    own; CachePilotPools can still reference them).
    """

    def __init__(self, router: Router, *, namespace: str, events: EventPoster,
                 clock: Callable[[], float], epp_service: str | None = None,
                 scrape_soon: Callable[[str, str], None] | None = None) -> None:
        self.router = router
        self.namespace = namespace
        self.events = events
        self.scrape_soon = scrape_soon  # (pool, address): the gateway's Scraper, if any
        self.clock = clock
        self.epp_service = epp_service
        self.pods: dict[str, PodView] = {}
        self.pools: dict[str, PoolState] = {}  # router pool name → state
        # Every InferencePool seen (ours or not: a CachePilotPool may reference any), parsed;
        # an invalid one as its error.
        self.inference_pools: dict[str, ip.InferencePoolView | InvalidSpec] = {}
        self.inference_pool_uids: dict[str, str] = {}
        # (kind, name) → when a watch event last touched it: resync must not undo fresher news.
        self.seen_at: dict[tuple[str, str], float] = {}

    # ---- CachePilotPools -----------------------------------------------------------------

    async def on_pool_event(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        name, uid = meta.get("name", ""), meta.get("uid", "")
        self.seen_at["pool", name] = self.clock()
        ps = self.pools.get(name)
        if event_type == "DELETED":
            if ps is not None and (not uid or not ps.uid or ps.uid == uid):
                self.drop_pool(ps)
                self._place_inference_pools()
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
        ps.body = body
        self._parse_and_apply(ps)
        self._place_inference_pools()

    def _parse_and_apply(self, ps: PoolState) -> None:
        """(Re)build CachePilotPool ``ps`` from its last body and, if it references one, the
        InferencePool as known now."""
        name = ps.name
        try:
            config = parse_pool(name, ps.body, source=None)
            if config.inference_pool is not None:
                config = self._with_inference_pool(name, ps.body, config.inference_pool)
        except InvalidSpec as e:
            ps.error = e
            if ps.warned_generation != ps.generation:
                ps.warned_generation = ps.generation
                kept = " (still routing with the previous valid spec)" if ps.config else ""
                self.events.emit(ps, "Warning", e.reason, f"{e.message}{kept}")
            log.warning("pool %s is invalid: %s: %s", name, e.reason, e.message)
            return
        self._apply(ps, config)

    def _with_inference_pool(self, name: str, body: Mapping[str, Any], ref: str) -> PoolConfig:
        known = self.inference_pools.get(ref)
        if known is None:
            hint = "" if self.epp_service is not None else (
                " (this gateway does not watch InferencePools: start it with --epp-service, "
                "or install the chart with epp.enabled=true)")
            raise InvalidSpec("InferencePoolNotFound", f"spec.inferencePoolRef: no InferencePool "
                              f"{ref!r} in namespace {self.namespace}{hint}")
        if isinstance(known, InvalidSpec):
            raise InvalidSpec("InvalidInferencePool",
                              f"InferencePool {ref!r} is invalid: {known.message}")
        return parse_pool(name, body, source=known.source)

    def _apply(self, ps: PoolState, config: PoolConfig) -> None:
        """Make the router's pool for ``ps`` follow a valid ``config``: the one place a pool
        is created or reconfigured, for CachePilotPools and InferencePools alike."""
        ps.error = None
        if ps.config is not None and ps.config == config:
            return  # a status-only or metadata-only change
        previous = ps.config
        ps.config = config
        if ps.pool is None:
            ps.pool = Pool(config.spec)
            self.router.add_pool(ps.pool)
        else:
            ps.pool.reconfigure(config.spec)
        if ps.pool.prompts is None or previous is None or previous.tokenizer != config.tokenizer:
            self._load_prompts(ps, config)
        self._sync_all_pods(ps)

    def _load_prompts(self, ps: PoolState, config: PoolConfig) -> None:
        """Read the files ``spec.routing.tokenizer`` names (I/O at the edge: the router only
        ever sees the loaded prompt path). A pool naming files that cannot be read hashes
        nothing exactly (its requests fall back, counted as ``no_tokenizer``) rather than
        borrow the gateway's tokenizer, which may be another model's."""
        assert ps.pool is not None
        src = config.tokenizer
        ps.pool.own_prompts = src is not None
        ps.pool.prompts = None
        if src is None:
            return
        try:
            ps.pool.prompts = load_prompts(
                src.path, chat_template=src.chat_template, content_format=src.content_format,
                lora_adapters=parse_lora_modules(src.lora_modules),
                served_models=src.served_model_names)
        except ModelFilesError as e:
            self.events.emit(ps, "Warning", "TokenizerUnavailable",
                             f"spec.routing.tokenizer: {e}; requests are matched "
                             "approximately")
            return
        if ps.pool.prompts.template is None:
            self.events.emit(ps, "Warning", "NoChatTemplate",
                             f"no chat template for {src.path}: chat requests are matched "
                             "approximately")

    # ---- InferencePools ------------------------------------------------------------------

    async def on_inference_pool_event(self, event_type: str | None,
                                      body: Mapping[str, Any]) -> None:
        """An InferencePool changed: re-derive every pool that depends on it."""
        meta = body.get("metadata") or {}
        name, uid = meta.get("name", ""), meta.get("uid", "")
        self.seen_at["inferencepool", name] = self.clock()
        if event_type == "DELETED":
            if uid and self.inference_pool_uids.get(name, uid) != uid:
                return  # an older incarnation's deletion
            self.inference_pools.pop(name, None)
            self.inference_pool_uids.pop(name, None)
        else:
            own = self.pools.get(ip.router_pool_name(name))
            if own is not None and self.inference_pool_uids.get(name, uid) != uid:
                self.drop_pool(own)  # recreated under our feet: a fresh pool
            self.inference_pool_uids[name] = uid
            try:
                self.inference_pools[name] = ip.parse(body)
            except InvalidSpec as e:
                previous = self.inference_pools.get(name)
                self.inference_pools[name] = e
                changed = not isinstance(previous, InvalidSpec) or previous.message != e.message
                if changed and (name in self.claimed() or _picker_name(body) == self.epp_service):
                    # Only about InferencePools that are ours: others' are their pickers' news.
                    self.events.emit(self._ip_ref(name, uid), "Warning", e.reason, e.message)
                log.warning("InferencePool %s is invalid: %s", name, e.message)
        for ps in list(self.pools.values()):
            if _reference(ps) == name:
                self._parse_and_apply(ps)
        self._place_inference_pools()

    def claimed(self) -> set[str]:
        """InferencePools some CachePilotPool references (valid or not: the user's intent)."""
        return {ref for ps in self.pools.values() if (ref := _reference(ps)) is not None}

    def _place_inference_pools(self) -> None:
        """An InferencePool picked by our Service and claimed by no CachePilotPool is a pool
        of its own (router defaults); any other has none."""
        claimed = self.claimed()
        wanted: dict[str, ip.InferencePoolView] = {}
        for name, view in self.inference_pools.items():
            if (isinstance(view, ip.InferencePoolView) and self.epp_service is not None
                    and view.picked_by(self.epp_service) and name not in claimed):
                wanted[ip.router_pool_name(name)] = view
        for key, ps in list(self.pools.items()):
            if ps.kind == ip.KIND and key not in wanted:
                self.drop_pool(ps)
        for key, view in wanted.items():
            ps = self.pools.get(key)
            if ps is None:
                ps = self.pools[key] = PoolState(
                    name=key, uid=view.uid, kind=ip.KIND,
                    body_ref=self._ip_ref(view.name, view.uid).body_ref)
            config = parse_pool(key, {"spec": {"inferencePoolRef": {"name": view.name}}},
                                source=view.source)
            self._apply(ps, config)

    def _ip_ref(self, name: str, uid: str) -> PoolState:
        """A stand-in PoolState for Events about an InferencePool that has no pool here."""
        return self.pools.get(ip.router_pool_name(name)) or PoolState(
            name=name, uid=uid, kind=ip.KIND,
            body_ref={"apiVersion": ip.API_VERSION, "kind": ip.KIND, "name": name,
                      "namespace": self.namespace, "uid": uid})

    # ---- pods ----------------------------------------------------------------------------

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
        if ps.pool is not None and self.router.pools.get(ps.name) is ps.pool:
            self.router.remove_pool(ps.name)
        self.pools.pop(ps.name, None)
        log.info("pool %s removed with %d workers", ps.name, len(ps.members))

    def _sync_all_pods(self, ps: PoolState) -> None:
        members = {m.pod for m in ps.members.values()}
        for name in sorted(set(self.pods) | members | ps.selected):
            self._sync_pod(ps, name)

    def _desired(self, ps: PoolState, pod: PodView | None) -> dict[str, Member]:
        """The members pod ``pod`` should be in ``ps``, keyed like ``ps.members``: the pod's
        name, or ``pod:port`` when the pool has several ports (an InferencePool's)."""
        cfg = ps.config
        if cfg is None or cfg.source is None or pod is None \
                or not cfg.source.selector.matches(pod.labels):
            ps.selected.discard(pod.name if pod else "")
            return {}
        ps.selected.add(pod.name)
        ports = [resolve_port(ref, pod) for ref in cfg.source.ports]
        scrape_ref = cfg.scrape.port
        if pod.ip is None or None in ports or (
                scrape_ref is not None and resolve_port(scrape_ref, pod) is None):
            ps.unresolved.add(pod.name)
            return {}
        ps.unresolved.discard(pod.name)
        kv = kv_event_endpoints(cfg.kv_events, pod) if cfg.kv_events is not None else None
        out = {}
        for port in ports:
            assert port is not None
            scrape_port = port if scrape_ref is None else resolve_port(scrape_ref, pod)
            assert scrape_port is not None
            key = pod.name if len(ports) == 1 else f"{pod.name}:{port}"
            out[key] = Member(pod=pod.name, address=host_port(pod.ip, port),
                              scrape_url=f"http://{host_port(pod.ip, scrape_port)}"
                                         f"{cfg.scrape.path}",
                              ready=pod.ready, kv_events=kv)
        return out

    def _sync_pod(self, ps: PoolState, name: str) -> None:
        """Make pool ``ps`` agree with pod ``name``: add, update readiness, or remove."""
        if ps.pool is None:
            return
        pod = self.pods.get(name)
        if pod is None:
            ps.selected.discard(name)
            ps.unresolved.discard(name)
        wanted = self._desired(ps, pod)
        for key in [k for k, m in ps.members.items() if m.pod == name]:
            have = ps.members[key]
            want = wanted.get(key)
            if want is not None and want.address == have.address:
                continue
            ps.pool.remove_worker(have.address)
            ps.kv_events.pop(have.address, None)
            ps.scrape_urls.pop(have.address, None)
            del ps.members[key]
            if have.ready:
                why = "deleted" if pod is None else "no longer selected"
                self.events.emit(ps, "Normal", "WorkerLeft",
                                 f"pod {name} ({have.address}) {why}")
        labels = dict(pod.labels) if pod is not None else {}
        for key, want in wanted.items():
            if want.kv_events is not None:
                ps.kv_events[want.address] = want.kv_events
            else:
                ps.kv_events.pop(want.address, None)
            # Set for members that stay too: spec.scrape's path or port may have changed.
            ps.scrape_urls[want.address] = want.scrape_url
            have = ps.members.get(key)
            if have is None:
                ps.pool.upsert_worker(want.address, ready=want.ready, labels=labels)
                ps.members[key] = want
                if want.ready:
                    self._joined(ps, want)
                continue
            have.kv_events = want.kv_events
            have.scrape_url = want.scrape_url
            if have.ready != want.ready:
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
        if self.scrape_soon is not None:
            self.scrape_soon(ps.name, m.address)


def _reference(ps: PoolState) -> str | None:
    """The InferencePool a CachePilotPool's last body references, if any."""
    if ps.kind != crd.KIND or not isinstance(ps.body, Mapping):
        return None
    spec = ps.body.get("spec")
    ref = spec.get("inferencePoolRef") if isinstance(spec, Mapping) else None
    name = ref.get("name") if isinstance(ref, Mapping) else None
    return name if isinstance(name, str) and name else None


def _picker_name(body: Mapping[str, Any]) -> str | None:
    """``spec.endpointPickerRef.name`` of a raw InferencePool body, however malformed."""
    spec = body.get("spec")
    ref = spec.get("endpointPickerRef") if isinstance(spec, Mapping) else None
    name = ref.get("name") if isinstance(ref, Mapping) else None
    return name if isinstance(name, str) else None
