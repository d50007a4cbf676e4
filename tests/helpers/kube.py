"""The real kopf operator against KMock, a real HTTP Kubernetes API emulator: the namespace's
paths, pods and CachePilotPools as the API server holds them, the cluster a test drives
through HTTP (so kopf's watch streams see every change), the operator of one gateway replica
(its own router and the one scrape loop it feeds) and a scripted metrics fetch.

The ``cluster`` fixture (tests/operator/conftest.py) is :func:`open_cluster` on the test's
KMock; a test that needs InferencePools too overrides it with ``inference_pools=True``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import kmock as K
import kopf

from cachepilot.core import InferenceRequest, Router, WorkerMetrics
from cachepilot.datalayer.engines import scrape_once
from cachepilot.datalayer.scrape import Scraper
from cachepilot.operator import OperatorOptions, run_operator
from cachepilot.operator import inferencepool as ip
from cachepilot.operator.crd import API_VERSION, GROUP, KIND, PLURAL, VERSION

NS = "serving"
PODS = f"/api/v1/namespaces/{NS}/pods"
POOLS = f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}"
EVENTS = f"/api/v1/namespaces/{NS}/events"
LEASES = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases"

FAST = OperatorOptions(status_min_interval_s=0.3, status_tick_s=0.05, lease_duration_s=1.5,
                       lease_renew_deadline_s=1.0, lease_retry_period_s=0.1,
                       api_backoffs=(0.05, 0.1, 0.2), watch_error_backoffs=(0.05, 0.1, 0.2),
                       resync_period_s=0.5, restart_backoffs=(0.1,))


class ScriptedScrape:
    """Scripted metrics per URL; an Exception value makes that worker's scrape fail."""

    def __init__(self) -> None:
        self.values: dict[str, dict[str, Any] | Exception] = {}
        self.calls: collections.Counter[str] = collections.Counter()
        self.engines: set[str] = set()

    async def __call__(self, session: aiohttp.ClientSession, url: str, engine: str,
                       timeout_s: float, now: Callable[[], float]) -> WorkerMetrics:
        self.calls[url] += 1
        self.engines.add(engine)
        value = self.values.get(url, {"waiting": 0, "running": 1, "kv_usage": 0.25})
        if isinstance(value, Exception):
            raise value
        return WorkerMetrics(scraped_at=now(), **value)


def pod(name: str, ip: str, labels: dict[str, str] | None = None, *, ready: bool = True,
        port: int = 8000, port_name: str = "http") -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}",
                     "labels": {"app": "llm"} if labels is None else labels},
        "spec": {"containers": [{"name": "engine", "image": "x",
                                 "ports": [{"name": port_name, "containerPort": port}]}]},
        "status": {"phase": "Running", "podIP": ip,
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def pool(name: str, **spec: Any) -> dict[str, Any]:
    body = {"selector": {"matchLabels": {"app": "llm"}}, "port": "http", "models": ["m1"],
            "scrape": {"intervalSeconds": 0.05, "engine": "sim"}}
    body.update(spec)
    return {"apiVersion": API_VERSION, "kind": KIND,
            "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "generation": 1},
            "spec": body}


class Cluster:
    def __init__(self, kmock: K.KubernetesEmulator, http: aiohttp.ClientSession) -> None:
        self.kmock, self.http = kmock, http
        self.url = str(kmock.url).rstrip("/")

    async def call(self, method: str, path: str, body: Any = None) -> Any:
        async with self.http.request(method, self.url + path, json=body) as r:
            assert r.status < 300, (method, path, r.status, await r.text())
            return await r.json(content_type=None)

    async def create(self, path: str, body: dict[str, Any]) -> None:
        await self.call("POST", path, body)

    async def patch(self, path: str, body: dict[str, Any]) -> None:
        await self.call("PATCH", path, body)

    async def delete(self, path: str) -> None:
        await self.call("DELETE", path)

    def obj(self, resource: str, name: str) -> dict[str, Any]:
        return self.kmock.objects[resource, NS, name].raw

    def status(self, name: str) -> dict[str, Any]:
        return self.obj(f"{GROUP}/{VERSION}/{PLURAL}", name).get("status") or {}

    def condition(self, name: str, type_: str = "Ready") -> dict[str, Any]:
        return next(c for c in self.status(name)["conditions"] if c["type"] == type_)

    def requests(self, method: str, path_prefix: str) -> list[Any]:
        return [r for r in self.kmock if r.method.value == method
                and r.url.path.startswith(path_prefix)]

    def events(self, reason: str | None = None) -> list[dict[str, Any]]:
        out = {r.data["metadata"]["name"]: r.data for r in self.requests("POST", EVENTS)}
        return [e for e in out.values() if reason is None or e["reason"] == reason]


_VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}


@contextlib.asynccontextmanager
async def open_cluster(kmock: K.KubernetesEmulator, *,
                       inference_pools: bool = False) -> AsyncIterator[Cluster]:
    """KMock with Kubernetes' bundled resources and CachePilotPools (and InferencePools,
    with ``inference_pools``), and an HTTP session to drive it."""
    kmock.resources.load_bundled()
    kmock.resources[f"{GROUP}/{VERSION}/{PLURAL}"] = K.ResourceInfo(
        kind=KIND, namespaced=True, subresources={"status"}, verbs=set(_VERBS))
    if inference_pools:
        kmock.resources[f"{ip.GROUP}/{ip.VERSION}/{ip.PLURAL}"] = K.ResourceInfo(
            kind=ip.KIND, namespaced=True, subresources={"status"}, verbs=set(_VERBS))
    async with aiohttp.ClientSession() as http:
        yield Cluster(kmock, http)


class Operator:
    """One gateway replica's operator: its own router, running until stopped."""

    def __init__(self, cluster: Cluster, scrape: ScriptedScrape | None, identity: str,
                 options: OperatorOptions = FAST,
                 objectives: dict[str, int] | None = None) -> None:
        self.router = Router()
        self.objectives = objectives
        self.stop, self.ready = asyncio.Event(), asyncio.Event()
        self.scraper = Scraper(self.router, scrape=scrape or scrape_once)
        self.task = asyncio.create_task(self._run(cluster, identity, options))

    async def _run(self, cluster: Cluster, identity: str, options: OperatorOptions) -> None:
        """The operator and, as in the gateway, the scrape loop it feeds; cancelling this
        task (or the operator ending) stops both."""
        scraping = asyncio.create_task(self.scraper.run())
        try:
            await run_operator(self.router, namespace=NS, stop_flag=self.stop,
                               ready_flag=self.ready, identity=identity,
                               login=lambda: kopf.ConnectionInfo(server=cluster.url),
                               scraper=self.scraper, options=options,
                               objectives=self.objectives)
        finally:
            scraping.cancel()
            await asyncio.gather(scraping, return_exceptions=True)

    @staticmethod
    def default_options(**changes: Any) -> OperatorOptions:
        return dataclasses.replace(FAST, **changes)

    async def __aenter__(self) -> Operator:
        async with asyncio.timeout(30):  # kopf's start-up, on a loaded machine
            await self.ready.wait()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        async with asyncio.timeout(10):
            await self.task

    def workers(self, pool_name: str = "p") -> dict[str, bool]:
        return {a: w.ready for a, w in self.router.pools[pool_name].workers.items()}

    def route(self, n: int, model: str = "m1") -> collections.Counter[str]:
        out: collections.Counter[str] = collections.Counter()
        for i in range(n):
            d = self.router.route(InferenceRequest(model=model, prompt=f"q{i} " * 50),
                                  time.time())
            self.router.release(d)
            out[d.chosen] += 1
        return out


async def three_pods(c: Cluster) -> None:
    for i in (1, 2, 3):
        await c.create(PODS, pod(f"w{i}", f"10.0.0.{i}"))


# InferencePools (upstream's CRD), and pods as a vLLM Deployment runs them.
INFPOOLS = f"/apis/{ip.GROUP}/{ip.VERSION}/namespaces/{NS}/{ip.PLURAL}"


def vllm_pod(name: str, ip_: str, *, ports: tuple[int, ...] = (8000, 8001),
             labels: dict[str, str] | None = None,
             annotations: dict[str, str] | None = None) -> dict[str, Any]:
    body = pod(name, ip_, labels={"app": "vllm"} if labels is None else labels)
    body["spec"]["containers"][0]["ports"] = [{"containerPort": p} for p in ports]
    if annotations:
        body["metadata"]["annotations"] = annotations
    return body


# Three real simulated workers on loopback (tests/operator/conftest.py's ``workers``).
HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
