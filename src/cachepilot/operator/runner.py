"""Run the operator inside the gateway process, beside the grpc.aio ext_proc server.

Why in-process: the router's view of workers (ready or not, fresh metrics or not) must be
current on every gateway replica at the moment it routes. The operator mutates the very
:class:`Router` the ext_proc handler reads, with no channel to lag, fail or secure. Each
replica runs its own watcher (kopf ``standalone``: no peering, which would pause all
replicas but one); only the Lease holder writes status and Events
(:mod:`cachepilot.operator.lease`).

Why kopf gets its own thread and event loop: when ``kopf.operator()`` exits it waits 5 s
for, then cancels, *every* task created in its loop since it started (kopf assumes it owns
the loop), and in the main thread it takes over SIGINT/SIGTERM. In the gateway's loop that
would cancel in-flight gRPC streams whenever the watcher restarts after an API outage. So
kopf runs in a thread; its handlers only forward each event to the gateway loop
(``run_coroutine_threadsafe``) and wait for it, which keeps per-object ordering, and every
router mutation still happens on the gateway's loop. Status, Events and the Lease run on the
gateway loop too; the workers' metrics come from the gateway's one scrape loop, which the
operator feeds each pool's scrape settings (:mod:`cachepilot.operator.scrape_sources`).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, MutableMapping
from typing import Any

import kopf

from cachepilot.core import Router
from cachepilot.datalayer.scrape import Scraper
from cachepilot.operator import crd
from cachepilot.operator import inferencepool as ip
from cachepilot.operator import objectives as obj
from cachepilot.operator.aio import wait_stopped
from cachepilot.operator.controller import Controller, OperatorOptions
from cachepilot.operator.kube import KubeClient
from cachepilot.operator.kv_sources import KVEventSources
from cachepilot.operator.lease import LeaderElector

log = logging.getLogger(__name__)

LoginFn = Callable[[], kopf.ConnectionInfo]


def default_login() -> kopf.ConnectionInfo:
    """In a pod: the service account. Elsewhere: the kubeconfig (KUBECONFIG or ~/.kube)."""
    logger = logging.getLogger("cachepilot.operator.login")
    settings = kopf.OperatorSettings()
    info = kopf.login_with_service_account(settings=settings, logger=logger)
    info = info or kopf.login_with_kubeconfig(settings=settings, logger=logger)
    if info is None:
        raise kopf.LoginError("no service account and no kubeconfig to log in with")
    return info


def default_identity() -> str:
    """Unique per replica: the pod name (HOSTNAME) plus a random suffix for restarts."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}-{os.urandom(3).hex()}"


def build_registry(controller: Controller, login: Callable[[], kopf.ConnectionInfo],
                   loop: asyncio.AbstractEventLoop) -> kopf.OperatorRegistry:
    """A private registry (not kopf's global one), so several operators can share a process
    (tests) and importing this module registers nothing. Each handler hands the event to
    the controller on ``loop`` (the gateway's) and waits. Event handlers, not
    on.create/update, because they write nothing to the watched objects: no finalizers, no
    annotations, no fights between replicas."""

    async def forward(handler: Callable[[str | None, dict[str, Any]], Any], type_: str | None,
                      body: kopf.Body) -> None:
        raw = copy.deepcopy(dict(body))  # a plain copy crosses threads, not kopf's view
        future = asyncio.run_coroutine_threadsafe(handler(type_, raw), loop)
        try:
            await asyncio.wrap_future(future)
        except Exception:  # never let kopf retry-loop an object; wait for its next event
            log.exception("handling %s %s", raw.get("kind"), raw.get("metadata", {}).get("name"))

    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def _login(**_: Any) -> kopf.ConnectionInfo:
        return login()

    @kopf.on.event(crd.GROUP, crd.VERSION, crd.PLURAL, registry=registry)
    async def _pool(type: str | None, body: kopf.Body, **_: Any) -> None:
        await forward(controller.on_pool_event, type, body)

    @kopf.on.event("v1", "pods", registry=registry)
    async def _pod(type: str | None, body: kopf.Body, **_: Any) -> None:
        await forward(controller.on_pod_event, type, body)

    if controller.options.objectives_group is not None:
        # Only when asked: without the InferenceObjective CRD the watch would fail forever.
        @kopf.on.event(controller.options.objectives_group, obj.VERSION, obj.PLURAL,
                       registry=registry)
        async def _objective(type: str | None, body: kopf.Body, **_: Any) -> None:
            await forward(controller.on_objective_event, type, body)

    if controller.options.epp_service is not None:
        # Only when asked: without the InferencePool CRD the watch would fail forever.
        @kopf.on.event(ip.GROUP, ip.VERSION, ip.PLURAL, registry=registry)
        async def _inference_pool(type: str | None, body: kopf.Body, **_: Any) -> None:
            await forward(controller.on_inference_pool_event, type, body)

    return registry


def build_settings(options: OperatorOptions) -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    # One namespace, known resources: no cluster-wide CRD/namespace scanning, so the RBAC
    # stays a namespaced Role. (The CRD must exist before the gateway starts; the chart
    # installs it first.)
    settings.scanning.disabled = True
    # We post our own Events, leader-only; kopf's would come from every replica.
    settings.posting.enabled = False
    # Never SIGKILL the gateway process if the operator part stops abnormally.
    settings.process.ultimate_exiting_timeout = None
    settings.networking.error_backoffs = options.watch_error_backoffs
    # Reconnect watches periodically even if the server keeps them open.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    return settings


def _run_kopf_thread(registry: kopf.OperatorRegistry, settings: kopf.OperatorSettings,
                     namespace: str, stop: threading.Event, ready: threading.Event,
                     done: Callable[[BaseException | None], None]) -> None:
    """Thread body: one kopf run on a fresh loop; report how it ended through ``done``."""
    error: BaseException | None = None
    try:
        asyncio.run(kopf.operator(registry=registry, settings=settings, namespaces=[namespace],
                                  clusterwide=False, standalone=True, stop_flag=stop,
                                  ready_flag=ready))
    except BaseException as e:
        error = e
    done(error)


async def run_operator(router: Router, *, namespace: str, stop_flag: asyncio.Event,
                       ready_flag: asyncio.Event | None = None,
                       identity: str | None = None,
                       login: LoginFn | None = None,
                       scraper: Scraper | None = None,
                       clock: Callable[[], float] = time.time,
                       options: OperatorOptions | None = None,
                       kv_events: KVEventSources | None = None,
                       objectives: MutableMapping[str, int] | None = None) -> None:
    """Watch CachePilotPools and their pods in ``namespace`` and keep ``router`` in step,
    until ``stop_flag`` is set. Call it as a task on the gateway's event loop.

    ``scraper`` is the gateway's scrape loop: the operator binds its pools' scrape settings
    to it and has it scrape each worker that joins at once (it does not run it: the gateway
    does). ``None``: nothing scrapes these pools (tests of the watch alone).
    ``clock`` must be the clock the gateway passes to ``Router.route(now=...)`` (the gateway
    uses ``time.time``): staleness is judged against it.
    ``ready_flag`` is set once kopf has started watching. Raises if the first login fails;
    later API trouble is retried (kopf's watcher is restarted with backoff), never raised
    into the gateway. ``kv_events`` (the gateway's ``GatewayConfig.kv_endpoints``) is bound to
    this operator's view: it answers where each worker publishes KV-cache events.
    ``objectives`` (flow control's name → priority table) follows the InferenceObjectives
    when ``options.objectives_group`` says to watch them.
    """
    options = options or OperatorOptions()
    login = login or default_login
    # kopf logs every handled event at INFO (each pod status update); keep the gateway's log
    # readable unless someone configured kopf's loggers on purpose.
    for name in ("kopf.objects", "kopf.activities"):
        if logging.getLogger(name).level == logging.NOTSET:
            logging.getLogger(name).setLevel(logging.WARNING)
    identity = identity or default_identity()
    info = await asyncio.to_thread(login)
    client = KubeClient(info, backoffs=options.api_backoffs)
    controller = Controller(router, namespace=namespace, scraper=scraper, client=client,
                            identity=identity, options=options, clock=clock,
                            kv_events=kv_events, objectives=objectives)
    loop = asyncio.get_running_loop()
    registry = build_registry(controller, login, loop)

    async def _kopf() -> None:
        """kopf retries API errors with backoff but gives up after its last backoff; the
        gateway must outlive an API outage, so restart it (after a relist) until stopped."""
        failures = 0
        while True:
            stop, ready = threading.Event(), threading.Event()
            ended: asyncio.Future[BaseException | None] = loop.create_future()
            thread = threading.Thread(
                target=_run_kopf_thread, name="kopf", daemon=True,
                args=(registry, build_settings(options), namespace, stop, ready,
                      functools.partial(loop.call_soon_threadsafe, ended.set_result)))
            thread.start()
            stopper = asyncio.ensure_future(stop_flag.wait())
            try:
                while not ended.done():
                    await asyncio.wait({ended, stopper}, timeout=0.05,
                                       return_when=asyncio.FIRST_COMPLETED)
                    if ready.is_set() and ready_flag is not None:
                        ready_flag.set()
                    if stop_flag.is_set():
                        stop.set()
            except asyncio.CancelledError:  # the gateway cancelled us instead of stop_flag
                stop.set()
                await asyncio.to_thread(thread.join, 10)
                raise
            finally:
                error = ended.result()
            await asyncio.to_thread(thread.join)
            if stop_flag.is_set():
                return
            delay = options.restart_backoffs[min(failures, len(options.restart_backoffs) - 1)]
            failures += 1
            log.warning("watcher stopped (%r); restarting in %ss", error, delay)
            if await wait_stopped(stop_flag, delay):
                return
            try:
                await controller.resync()
            except Exception as e:
                log.warning("resync before restart failed: %s", e)

    log.info("operator %s watching namespace %s", identity, namespace)
    try:
        async with asyncio.TaskGroup() as tg:
            kopf_task = tg.create_task(_kopf(), name="kopf")
            tg.create_task(controller.status_loop(stop_flag), name="status")
            tg.create_task(controller.event_loop(stop_flag), name="events")
            if options.elect_leader:
                elector = LeaderElector(
                    client, namespace=namespace, name=options.lease_name, identity=identity,
                    lease_duration_s=options.lease_duration_s,
                    renew_deadline_s=options.lease_renew_deadline_s,
                    retry_period_s=options.lease_retry_period_s,
                    on_change=controller.set_leader)
                tg.create_task(elector.run(stop_flag), name="lease")
            tg.create_task(controller.resync_loop(stop_flag), name="resync")
            await kopf_task
    except BaseExceptionGroup as group:  # one plain exception for the caller
        raise group.exceptions[0] from None
    finally:
        await client.close()
