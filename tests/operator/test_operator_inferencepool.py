"""The real kopf operator against KMock with InferencePools: an InferencePool whose endpoint
picker is our Service becomes a pool, a CachePilotPool can take it over with its own settings,
and each pool's KV-event publishers reach the gateway's KVEventHub as pods come and go."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import kmock as K
import kopf
import pytest

from cachepilot.core import Router
from cachepilot.core.kv_events import BlockStored
from cachepilot.datalayer.kv_events import KVEventHub, follow_pools
from cachepilot.operator import KVEventSources, OperatorOptions, run_operator
from cachepilot.operator import inferencepool as ip
from cachepilot.tooling.kv_event_publisher import KVEventPublisher

from helpers.kube import (
    EVENTS,
    FAST,
    INFPOOLS,
    NS,
    PODS,
    POOLS,
    Cluster,
    Operator,
    ScriptedScrape,
    open_cluster,
    pod,
    pool,
    vllm_pod,
)
from helpers.polling import eventually, holds_for
from helpers.schemas import infpool, validate_inference_pool

pytestmark = pytest.mark.timeout(60)

EPP = "cp-cachepilot-epp"
OPTIONS = Operator.default_options(epp_service=EPP)


@pytest.fixture
async def cluster(kmock: K.KubernetesEmulator) -> AsyncIterator[Cluster]:
    """The operator tests' cluster, with InferencePools too."""
    async with open_cluster(kmock, inference_pools=True) as c:
        yield c


def workers(router: Router, name: str) -> dict[str, bool]:
    return {a: w.ready for a, w in router.pools[name].workers.items()}


async def test_an_inference_pool_picked_by_us_becomes_a_pool(cluster: Cluster) -> None:
    scraper = ScriptedScrape()
    for i in (1, 2):
        await cluster.create(PODS, vllm_pod(f"v{i}", f"10.0.0.{i}"))
    await cluster.create(PODS, vllm_pod("web", "10.0.9.9", labels={"app": "web"}))
    mine, theirs = infpool("llama", ports=(8000, 8001)), infpool("other", picker="their-epp")
    for body in (mine, theirs):
        validate_inference_pool(body)
    async with Operator(cluster, scraper, "gw-0", OPTIONS) as op:
        await cluster.create(INFPOOLS, mine)
        await cluster.create(INFPOOLS, theirs)
        name = ip.router_pool_name("llama")
        # Every target port of every selected pod is a worker of its own, scraped on it.
        await eventually(lambda: workers(op.router, name) == {
            "10.0.0.1:8000": True, "10.0.0.1:8001": True,
            "10.0.0.2:8000": True, "10.0.0.2:8001": True}, what="the InferencePool's workers")
        await eventually(lambda: all(w.metrics for w in op.router.pools[name].workers.values()))
        assert "http://10.0.0.2:8001/metrics" in scraper.calls
        assert set(op.router.pools) == {name}  # another picker's pool is not ours
        assert op.router.pools[name].spec.models == ()  # serves any model
        assert set(op.route(20)) <= set(workers(op.router, name))
        # The InferencePool's own changes move the workers.
        await cluster.patch(f"{INFPOOLS}/llama", {"spec": {"targetPorts": [{"number": 8001}]}})
        await eventually(lambda: set(workers(op.router, name)) == {"10.0.0.1:8001",
                                                                  "10.0.0.2:8001"})
        await cluster.create(PODS, vllm_pod("v3", "10.0.0.3"))
        await eventually(lambda: "10.0.0.3:8001" in workers(op.router, name))
        # Pointing it at another endpoint picker, or deleting it, removes the pool.
        await cluster.patch(f"{INFPOOLS}/llama", {"spec": {"endpointPickerRef": {
            "name": "their-epp"}}})
        await eventually(lambda: name not in op.router.pools, what="pool gone on re-point")
        await cluster.patch(f"{INFPOOLS}/llama", {"spec": {"endpointPickerRef": {"name": EPP}}})
        await eventually(lambda: name in op.router.pools)
        await cluster.delete(f"{INFPOOLS}/llama")
        await eventually(lambda: name not in op.router.pools, what="pool gone on delete")
    # Upstream's status belongs to the gateways: the picker never writes it (nor any status:
    # there is no CachePilotPool here).
    assert not [r for r in cluster.requests("PATCH", INFPOOLS) if r.url.path.endswith("/status")]
    assert not cluster.requests("PATCH", POOLS)
    joined = [e for e in cluster.events("WorkerJoined")
              if e["involvedObject"]["kind"] == ip.KIND]
    assert joined and all(e["involvedObject"]["name"] == "llama" for e in joined)
    assert all(e["metadata"]["name"].startswith("llama.") for e in joined)


async def test_a_cachepilot_pool_takes_over_an_inference_pool(cluster: Cluster) -> None:
    for i in (1, 2):
        await cluster.create(PODS, vllm_pod(f"v{i}", f"10.0.0.{i}", ports=(8000,)))
    async with Operator(cluster, ScriptedScrape(), "gw-0", OPTIONS) as op:
        await cluster.create(INFPOOLS, infpool("llama"))
        bare = ip.router_pool_name("llama")
        await eventually(lambda: len(op.router.pools[bare].workers) == 2)
        body = pool("tuned", models=["llama-3"], routing={"policy": "least_loaded"},
                    inferencePoolRef={"name": "llama"})
        del body["spec"]["selector"], body["spec"]["port"]
        await cluster.create(POOLS, body)
        # One pool per worker set: the CachePilotPool's, with its own settings.
        await eventually(lambda: set(op.router.pools) == {"tuned"}
                         and workers(op.router, "tuned") == {"10.0.0.1:8000": True,
                                                             "10.0.0.2:8000": True})
        assert op.router.pools["tuned"].spec.policy == "least_loaded"
        assert op.router.pools["tuned"].spec.models == ("llama-3",)
        await eventually(lambda: cluster.condition("tuned")["reason"] == "WorkersReady")
        # The InferencePool's selector still decides the workers.
        await cluster.patch(f"{INFPOOLS}/llama", {"spec": {"selector": {"matchLabels": {
            "app": "vllm", "zone": "a"}}}})
        await cluster.patch(f"{PODS}/v2", {"metadata": {"labels": {"app": "vllm",
                                                                    "zone": "a"}}})
        await eventually(lambda: workers(op.router, "tuned") == {"10.0.0.2:8000": True})
        # The referenced InferencePool disappears: the pool says so (and keeps its last view).
        await cluster.delete(f"{INFPOOLS}/llama")
        await eventually(lambda: cluster.condition("tuned", "Valid")["reason"]
                         == "InferencePoolNotFound")
        await holds_for(lambda: bare not in op.router.pools, 0.3, "no bare pool")
        # Dropping the CachePilotPool hands a re-created InferencePool back to its own pool.
        await cluster.create(INFPOOLS, infpool("llama"))
        await eventually(lambda: cluster.condition("tuned", "Valid")["status"] == "True")
        await cluster.delete(f"{POOLS}/tuned")
        await eventually(lambda: set(op.router.pools) == {bare}, what="the bare pool back")


async def test_a_reference_to_a_missing_inference_pool_is_a_condition(cluster: Cluster) -> None:
    async with Operator(cluster, ScriptedScrape(), "gw-0", OPTIONS) as op:
        body = pool("tuned", inferencePoolRef={"name": "nope"})
        del body["spec"]["selector"], body["spec"]["port"]
        await cluster.create(POOLS, body)
        await eventually(lambda: cluster.condition("tuned", "Valid")["reason"]
                         == "InferencePoolNotFound")
        assert cluster.condition("tuned")["status"] == "False"
        assert "tuned" not in op.router.pools
        warnings = cluster.events("InferencePoolNotFound")
        assert warnings and warnings[0]["type"] == "Warning"
        # An invalid InferencePool of ours gets a Warning Event of its own and makes no pool;
        # one of another picker's is not ours to report.
        await cluster.create(INFPOOLS, infpool("theirs", picker="their-epp", ports=(80, 80)))
        await cluster.create(INFPOOLS, infpool("dup", ports=(8000, 8000)))
        await eventually(lambda: any(e["involvedObject"]["name"] == "dup"
                                     for e in cluster.events("InvalidPort")))
        assert ip.router_pool_name("dup") not in op.router.pools
        assert [e["involvedObject"]["name"] for e in cluster.events("InvalidPort")] == ["dup"]


async def test_inference_pools_are_not_watched_unless_asked(cluster: Cluster) -> None:
    await cluster.create(PODS, vllm_pod("v1", "10.0.0.1", ports=(8000,)))
    await cluster.create(INFPOOLS, infpool("llama"))
    async with Operator(cluster, ScriptedScrape(), "gw-0", FAST) as op:
        body = pool("tuned", inferencePoolRef={"name": "llama"})
        del body["spec"]["selector"], body["spec"]["port"]
        await cluster.create(POOLS, body)
        # A reference cannot resolve, and the condition says why.
        await eventually(lambda: "--epp-service" in cluster.condition("tuned", "Valid")[
            "message"])
        await holds_for(lambda: not op.router.pools, 0.3, "no pool without --epp-service")
    assert not cluster.requests("GET", INFPOOLS)


@contextlib.asynccontextmanager
async def operator_with_kv_hub(cluster: Cluster, options: OperatorOptions
                               ) -> AsyncIterator[tuple[Router, KVEventHub, KVEventSources]]:
    """The operator and the gateway's KV-event hub, wired as ``cachepilot gateway
    --kubernetes`` wires them (KVEventSources as GatewayConfig.kv_endpoints)."""
    router, stop, ready = Router(), asyncio.Event(), asyncio.Event()
    sources, hub = KVEventSources(), KVEventHub(tick=0.05)
    task = asyncio.create_task(run_operator(
        router, namespace=NS, stop_flag=stop, ready_flag=ready, identity="gw-0",
        login=lambda: kopf.ConnectionInfo(server=cluster.url),
        options=options, kv_events=sources))
    follow = asyncio.create_task(follow_pools(hub, router.pools, sources, every_s=0.05))
    try:
        async with asyncio.timeout(10):
            await ready.wait()
        yield router, hub, sources
    finally:
        follow.cancel()
        await hub.stop()
        stop.set()
        async with asyncio.timeout(10):
            await task


async def test_kv_event_publishers_are_followed_as_pods_come_and_go(cluster: Cluster) -> None:
    pub = KVEventPublisher()  # ports picked by the OS: no race with other tests for them
    port = int(pub.endpoint.rsplit(":", 1)[1])
    replay = int(pub.replay_endpoint.rsplit(":", 1)[1])
    annotation = "cachepilot.io/kv-events-port"
    body = pool("p", kvEvents={"portAnnotation": annotation, "replayPort": replay})
    try:
        async with operator_with_kv_hub(cluster, FAST) as (router, hub, sources):
            await cluster.create(POOLS, body)
            await cluster.create(PODS, pod("w1", "127.0.0.1") | {"metadata": {
                "name": "w1", "namespace": NS, "uid": "uid-w1", "labels": {"app": "llm"},
                "annotations": {annotation: str(port)}}})
            await cluster.create(PODS, pod("w2", "127.0.0.2"))  # publishes nothing it says
            await eventually(lambda: set(router.pools["p"].workers) == {"127.0.0.1:8000",
                                                                        "127.0.0.2:8000"})
            await eventually(lambda: hub.workers() == ["127.0.0.1:8000"])
            ep = sources("p", "127.0.0.1:8000")
            assert (ep.events, ep.replay, ep.topic) == (
                f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}", "kv-events")
            assert sources("p", "127.0.0.2:8000") is None
            # The engine's events reach the pool's directory: exact mode.
            directory = router.pools["p"].directory

            def arrived() -> bool:
                if directory.match([11, 12, 13], ["127.0.0.1:8000"])["127.0.0.1:8000"] == 3:
                    return True
                pub.publish([BlockStored((11, 12, 13))])  # until the subscription is up
                return False

            await eventually(arrived, timeout=10, interval=0.1, retry_on=(),
                             what="the events reaching the directory")
            await eventually(lambda: hub.mode("127.0.0.1:8000") == "exact")
            # The pool's status says which workers' directories follow their events.
            await eventually(lambda: {w["pod"]: w.get("directoryMode")
                                      for w in cluster.status("p")["workerStatus"]}
                             == {"w1": "exact", "w2": None}, what="directoryMode in status")
            # The pod goes: the subscription goes with it.
            await cluster.delete(f"{PODS}/w1")
            await eventually(lambda: hub.workers() == [], what="the subscription dropped")
            assert sources("p", "127.0.0.1:8000") is None
            # A pool without kvEvents follows nothing (no fallback configured).
            await cluster.patch(f"{POOLS}/p", {"spec": {"kvEvents": None}})
            await cluster.create(PODS, pod("w3", "127.0.0.3") | {"metadata": {
                "name": "w3", "namespace": NS, "uid": "uid-w3", "labels": {"app": "llm"},
                "annotations": {annotation: str(port)}}})
            await eventually(lambda: "127.0.0.3:8000" in router.pools["p"].workers)
            await holds_for(lambda: hub.workers() == [], 0.3, "no subscription without kvEvents")
    finally:
        pub.close()
    warnings = {r.data["reason"] for r in cluster.requests("POST", EVENTS)
                if r.data["type"] == "Warning"}
    # The pool came before its pods; nothing scrapes here, so metrics may be reported stale
    # (what this test checks is the KV-event sources, not scraping).
    assert warnings <= {"NoMatchingPods", "MetricsStale"}, warnings
