"""The gateway process: ext_proc over grpc.aio, gRPC health, the admin/metrics HTTP API and
the scraper, all on one asyncio loop around one Router (which is not thread-safe)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from aiohttp import web
from envoy.service.accesslog.v3 import als_pb2_grpc as als_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from cachepilot.core.flow.config import FlowConfig
from cachepilot.core.flow.control import FlowControl
from cachepilot.core.router import Router
from cachepilot.datalayer.kv_events import EndpointsFor, KVEventHub, follow_pools
from cachepilot.datalayer.scrape import Scraper, StaticTargets
from cachepilot.gateway import predictor_state
from cachepilot.gateway.director import Director, GatewayOptions
from cachepilot.gateway.flow_metrics import FlowMetrics
from cachepilot.gateway.gateway_metrics import GatewayMetrics
from cachepilot.gateway.local_peers import LocalPeers
from cachepilot.gateway.plugins import MetricsPlugin, StallTracker
from cachepilot.gateway.processes import ProcessSlot
from cachepilot.gateway.replica_bus import ReplicaBus
from cachepilot.gateway.service import AccessLogServicer, ExtProcServicer
from cachepilot.records import open_recorder
from cachepilot.records.explain import summary
from cachepilot.records.plugins import DecisionSink, lifecycle_plugins

log = logging.getLogger("cachepilot.gateway")

EPP_HEALTH_SERVICES = ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")
# While requests are held, the pump also runs this often: a safety net for capacity that
# frees without an event (a worker made ready by the operator, a stall cleared).
FLOW_POLL_S = 0.05


@dataclass
class GatewayConfig:
    grpc_address: str = "127.0.0.1:9002"
    admin_host: str = "127.0.0.1"  # loopback unless an admin token is set
    admin_port: int = 9090
    admin_token: str | None = None
    scrape_interval_s: float = 0.25  # these two: static workers (a CachePilotPool has its own)
    scrape_timeout_s: float = 1.0
    options: GatewayOptions | None = None
    grace_s: float = 5.0
    decision_log: str | None = None  # record every decision here (LMDB directory)
    calibrate: bool = True  # learn each worker's TTFT model from measured first tokens
    # A worker whose requests get no first byte for this long (and that answered none of
    # them meanwhile) is taken out of routing until its requests end or it answers. 0: off.
    stall_after_s: float = 10.0
    # Share placements and in-flight bookings with the other gateway replicas over this NATS
    # server (cachepilot.gateway.replica_bus); None: route alone.
    replica_bus: str | None = None
    replica_id: str = ""  # this replica's name on the bus (default: host and pid)
    replica_subject: str = "cachepilot.sync"  # one per deployment sharing a NATS server
    # One of the processes of ``cachepilot gateway --processes N`` (None: the only one):
    # without a replica bus they share state over local sockets (gateway.local_peers).
    process: ProcessSlot | None = None
    extra_listen: tuple[str, ...] = ()  # more ext_proc addresses (SO_REUSEPORT, shared)
    # vLLM KV-cache events (cachepilot.datalayer.kv_events): where each worker publishes them
    # (None: no subscriptions; the directory stays routing-learned).
    kv_endpoints: EndpointsFor | None = None
    # Flow control (cachepilot.core.flow): hold, prioritise and share fairly instead of
    # answering 429 at the admission limit. enabled=False restores the old behaviour.
    flow: FlowConfig = field(default_factory=FlowConfig)
    # Where the TTFT predictor's fits are kept across restarts (None: each start learns from
    # the prior; gateway.predictor_state).
    predictor_state: str | None = None


class Gateway:
    def __init__(self, router: Router, config: GatewayConfig | None = None,
                 sink: DecisionSink | None = None) -> None:
        self.router = router
        self.config = config or GatewayConfig()
        self.metrics = GatewayMetrics()
        options = self.config.options or GatewayOptions()
        self.recorder = open_recorder(self.config.decision_log, router=router,
                                      registry=self.metrics.registry,
                                      capture_prompts=options.capture_prompts
                                      ) if sink is None else None
        recording = sink or (self.recorder if self.config.decision_log else None)
        self.stalls = StallTracker()
        replica = None
        slot = self.config.process
        if self.config.replica_bus:
            replica = self.config.replica_id or f"{socket.gethostname()}-{os.getpid()}"
            if slot is not None and self.config.replica_id:
                replica += f"-p{slot.index}"
        elif slot is not None and slot.count > 1:
            replica = f"p{slot.index}"
        life = lifecycle_plugins(learn=self.config.calibrate, replica=replica, sink=recording,
                                 capture_prompts=options.capture_prompts,
                                 extra=(MetricsPlugin(self.metrics), self.stalls))
        for plugin in life.plugins:
            router.add_plugin(plugin)
        self.predictor = life.predictor
        self.bus: ReplicaBus | LocalPeers | None = None
        if life.sync is not None and self.config.replica_bus:
            self.bus = ReplicaBus(router, life.sync, self.config.replica_bus,
                                  subject=self.config.replica_subject)
        elif life.sync is not None:
            assert slot is not None
            self.bus = LocalPeers(router, life.sync, slot.group, slot.index, slot.count)
        self.flow: FlowControl | None = None
        self.flow_metrics: FlowMetrics | None = None
        self._flow_wake = asyncio.Event()
        if self.config.flow.enabled:
            self.flow = FlowControl(router, self.config.flow)
            self.flow_metrics = FlowMetrics(self.metrics.registry, self.flow)
            self.flow.observers.append(self.flow_metrics)
            self.flow.kick = self._kick
            router.add_plugin(self.flow.plugin)
        self.director = Director(router, options=options,
                                 on_passthrough=self.metrics.passthrough.inc, flow=self.flow)
        self.servicer = ExtProcServicer(self.director)
        # The one scrape loop; the operator, if any, binds its pools' settings to it.
        self.scraper = Scraper(router, StaticTargets(self.config.scrape_interval_s,
                                                     self.config.scrape_timeout_s))
        self.scraper.on_update = self._kick
        self.kv_events = KVEventHub()
        self.health = health.aio.HealthServicer()
        self._grpc: grpc.aio.Server | None = None
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Future[Any]] = []
        self.failed = asyncio.Event()
        self.grpc_port = 0
        self.admin_port = 0

    async def start(self) -> None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
        ep_grpc.add_ExternalProcessorServicer_to_server(self.servicer, server)
        als_grpc.add_AccessLogServiceServicer_to_server(
            AccessLogServicer(self.servicer.streams), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self.grpc_port = server.add_insecure_port(self.config.grpc_address)
        if not self.grpc_port:
            raise OSError(f"cannot listen on {self.config.grpc_address}")
        for address in self.config.extra_listen:
            if not server.add_insecure_port(address):
                raise OSError(f"cannot listen on {address}")
        state = self.config.predictor_state
        if state and self.predictor is not None:
            predictor_state.load(self.predictor, state)
            self._tasks.append(asyncio.create_task(
                predictor_state.keep_saved(self.predictor, state)))
        await server.start()
        self._grpc = server
        self._tasks.append(asyncio.create_task(self.scraper.run()))
        if self.flow is not None:
            self._tasks.append(asyncio.create_task(self._flow_loop()))
        if self.config.stall_after_s > 0:
            self._tasks.append(asyncio.create_task(self._watch_stalls()))
        if self.bus is not None:
            await self.bus.start()
        if self.config.kv_endpoints is not None:
            self._tasks.append(asyncio.create_task(
                follow_pools(self.kv_events, self.router.pools, self.config.kv_endpoints)))
        self._runner = web.AppRunner(self._admin_app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.admin_host, self.config.admin_port)
        await site.start()
        self.admin_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        # The endpoint picker protocol's health services (liveness, readiness, the ext_proc
        # service itself; docs/proposals/004-endpoint-picker-protocol), and the server's.
        for service in ("", *EPP_HEALTH_SERVICES):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("gateway: ext_proc on :%d, admin on %s:%d", self.grpc_port,
                 self.config.admin_host, self.admin_port)

    def add_task(self, coro: Awaitable[Any]) -> None:
        """Run something (the operator) for the gateway's lifetime; cancelled at stop().
        If it fails, the gateway stops too: better a visible crash loop than routing on a
        view that no longer updates."""
        task = asyncio.ensure_future(coro)
        task.add_done_callback(self._task_done)
        self._tasks.append(task)

    def _task_done(self, task: asyncio.Future[Any]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed; stopping", exc_info=task.exception())
            self.failed.set()

    async def stop(self) -> None:
        """Graceful: report NOT_SERVING, let open streams finish for ``grace_s``, then stop."""
        await self.health.enter_graceful_shutdown()
        if self._grpc is not None:
            await self._grpc.stop(self.config.grace_s)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.config.predictor_state and self.predictor is not None:
            predictor_state.save(self.predictor, self.config.predictor_state)
        if self.bus is not None:
            await self.bus.stop()
        await self.kv_events.stop()
        await self.scraper.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self.recorder is not None:
            self.recorder.close()

    def _kick(self) -> None:
        """Capacity may have freed (a first token, a finish, a scrape): pump soon, if
        anything is held (nothing to do otherwise, and this runs for every request)."""
        if self.flow is not None and self.flow.held:
            self._flow_wake.set()

    async def _flow_loop(self) -> None:
        """Dispatch held requests when capacity frees, and refuse those whose time runs out:
        one task, so the router is only ever driven from the event loop's thread."""
        flow = self.flow
        assert flow is not None
        wake = self._flow_wake
        while True:
            if flow.held:
                now = time.time()
                timeout = min(FLOW_POLL_S, max(0.0, flow.next_deadline(now) - now))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout):
                        await wake.wait()
            else:
                await wake.wait()
            wake.clear()
            if flow.held:
                try:
                    flow.pump(time.time())
                except Exception:  # a bug must not stop dispatching for good
                    log.exception("flow control: pump failed")

    async def _watch_stalls(self) -> None:
        """Price out a hung worker as its requests age: down while its requests wait without
        a first byte, back once they have ended (Envoy's first-byte timeout) or it answers.
        Routed requests no observing stream took over are released here too."""
        after = self.config.stall_after_s
        while True:
            await asyncio.sleep(min(1.0, after / 4))
            now = time.time()
            self.servicer.streams.sweep(now)
            stalled = self.stalls.stalled(now, after)
            for pool in self.router.pools.values():
                for addr, w in pool.workers.items():
                    why = stalled.get(addr)
                    if why != w.down.get("stalled"):
                        if why and "stalled" not in w.down:
                            log.warning("worker %s %s", addr, why)
                        pool.set_down(addr, "stalled", why)

    # -- admin API ----------------------------------------------------------------------------
    def _admin_app(self) -> web.Application:
        token = self.config.admin_token

        @web.middleware
        async def auth(request: web.Request, handler: Callable[..., Awaitable[web.StreamResponse]]
                       ) -> web.StreamResponse:
            public = request.path in ("/healthz", "/readyz", "/metrics")
            if token and not public and request.headers.get("authorization") != f"Bearer {token}":
                return web.json_response({"error": "missing or wrong bearer token"}, status=401)
            return await handler(request)

        app = web.Application(middlewares=[auth])
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/workers", self._workers)
        app.router.add_get("/pools", self._pools)
        app.router.add_get("/decisions/{id}", self._decision)
        app.router.add_get("/predictor", self._predictor)
        app.router.add_get("/replicas", self._replicas)
        app.router.add_get("/flow", self._flow)
        return app

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _readyz(self, _: web.Request) -> web.Response:
        ready = any(w.ready and w.metrics is not None
                    for p in self.router.pools.values() for w in p.workers.values())
        return web.Response(text="ready" if ready else "no ready worker",
                            status=200 if ready else 503)

    async def _metrics(self, _: web.Request) -> web.Response:
        self.metrics.refresh_workers(self.router, self.kv_events.status())
        if self.flow_metrics is not None:
            self.flow_metrics.refresh(time.time())
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _workers(self, _: web.Request) -> web.Response:
        out = []
        events = self.kv_events.status()
        for pool in self.router.pools.values():
            for addr, w in pool.workers.items():
                m = w.metrics
                out.append({"pool": pool.name, "address": addr, "ready": w.ready,
                            "inflight": w.inflight, "assigned": w.assigned,
                            "pending_prefill_tokens": w.pending_prefill_tokens,
                            "waiting": m.waiting if m else None,
                            "running": m.running if m else None,
                            "kv_usage": m.kv_usage if m else None,
                            "scraped_at": m.scraped_at if m else None,
                            "scrape_error": w.scrape_error, "down": w.down,
                            "engine_started": m.process_start if m else None,
                            "engine_restarts": w.engine_restarts,
                            "directory_mode": pool.directory.mode(addr),
                            "kv_events": events.get(addr)})
        return web.json_response(out)

    async def _pools(self, _: web.Request) -> web.Response:
        return web.json_response([{
            "name": p.name, "models": list(p.spec.models), "policy": p.policy.name,
            "weights": p.spec.weights.to_dict(), "block_size": p.spec.block.block_size,
            "decisions": p.seq, "directory": p.directory.stats(),
            "distinct_blocks": p.directory.distinct_blocks(), "modes": p.directory.modes()}
            for p in self.router.pools.values()])

    async def _decision(self, request: web.Request) -> web.Response:
        if not self.config.decision_log or self.recorder is None:
            return web.json_response({"error": "no decision log configured "
                                               "(--decision-log)"}, status=404)
        rec = self.recorder.get(request.match_info["id"])
        if rec is None:  # maybe still queued (an idle writer ticks every 0.5 s): write it
            await asyncio.to_thread(self.recorder.flush, 2.0)
            rec = self.recorder.get(request.match_info["id"])
        if rec is None:
            return web.json_response({"error": "no such decision"}, status=404)
        return web.json_response({"record": rec, "explanation": summary(rec)})

    async def _predictor(self, _: web.Request) -> web.Response:
        """Each worker's learned TTFT model and the predictor's recent accuracy."""
        if self.predictor is None:
            return web.json_response({"error": "learning is off (--no-calibrate)"}, status=404)
        return web.json_response({"workers": self.predictor.estimates(),
                                  "accuracy": self.predictor.accuracy()})

    async def _flow(self, _: web.Request) -> web.Response:
        """Flow control's settings and what it holds now, by pool and band."""
        if self.flow is None:
            return web.json_response({"error": "flow control is off (--flow-control off)"},
                                     status=404)
        return web.json_response({"config": self.flow.config.to_dict(),
                                  "held": self.flow.held,
                                  "objectives": self.flow.objectives,
                                  "bands": self.flow.snapshot(time.time())})

    async def _replicas(self, _: web.Request) -> web.Response:
        """This replica's exchange with the others (bus, bookings, counters)."""
        if self.bus is None:
            return web.json_response({"error": "no replica bus (--replica-bus)"}, status=404)
        return web.json_response(self.bus.status())


async def serve(gateway: Gateway, ready: Callable[[Gateway], None] | None = None) -> None:
    """Run until SIGINT/SIGTERM, then shut down gracefully."""
    await gateway.start()
    if ready:
        ready(gateway)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(gateway.failed.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    await gateway.stop()
    if gateway.failed.is_set():
        raise SystemExit(1)
