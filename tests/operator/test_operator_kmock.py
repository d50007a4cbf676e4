"""The real kopf operator (run_operator) against KMock, a real HTTP Kubernetes API emulator.

Each test starts ``run_operator`` on the test's event loop, drives the "cluster" through
HTTP (so kopf's watch streams see every change) and checks the router, the status
subresource and the Events. Worker metrics come from the one scrape loop
(``cachepilot.datalayer.scrape.Scraper``, as the gateway runs it) with a scripted metrics
fetch in place of ``cachepilot.datalayer.engines.scrape_once``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import kmock as K
import pytest

from cachepilot.core import InferenceRequest, RequestError, RoutingError
from cachepilot.operator.crd import API_VERSION, KIND

from helpers.kube import (
    EVENTS,
    FAST,
    LEASES,
    NS,
    PODS,
    POOLS,
    Cluster,
    Operator,
    ScriptedScrape,
    pod,
    pool,
    three_pods,
)
from helpers.polling import eventually, holds_for

pytestmark = pytest.mark.timeout(60)


async def test_ready_pods_become_workers_and_scrapes_reach_the_router(cluster: Cluster) -> None:
    scraper = ScriptedScrape()
    scraper.values["http://10.0.0.2:8000/metrics"] = {"waiting": 7, "running": 3,
                                                       "kv_usage": 0.5}
    await three_pods(cluster)
    await cluster.create(PODS, pod("w4", "10.0.0.4", ready=False))
    await cluster.create(PODS, pod("other", "10.0.0.9", labels={"app": "web"}))
    async with Operator(cluster, scraper, "gw-0") as op:
        await cluster.create(POOLS, pool("p"))
        await eventually(lambda: op.workers() == {"10.0.0.1:8000": True, "10.0.0.2:8000": True,
                                                  "10.0.0.3:8000": True,
                                                  "10.0.0.4:8000": False})
        w2 = await eventually(lambda: op.router.pools["p"].workers["10.0.0.2:8000"].metrics)
        assert (w2.waiting, w2.running, w2.kv_usage) == (7, 3, 0.5)
        assert scraper.engines == {"sim"}
        assert "http://10.0.0.4:8000/metrics" not in scraper.calls  # not ready: not scraped
        await eventually(lambda: all(w.metrics for a, w in op.router.pools["p"].workers.items()
                                     if w.ready))
        # The pool's spec reaches the router, and only ready workers get requests.
        assert op.router.pools["p"].spec.models == ("m1",)
        assert set(op.route(30)) <= {"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}
        # A pod that turns ready joins; a pod added later joins too.
        await cluster.patch(f"{PODS}/w4", {"status": {"conditions": [
            {"type": "Ready", "status": "True"}]}})
        await cluster.create(PODS, pod("w5", "10.0.0.5"))
        await eventually(lambda: op.workers()["10.0.0.4:8000"] and op.workers()["10.0.0.5:8000"])


async def test_several_pools_route_by_model_to_their_own_workers(cluster: Cluster) -> None:
    for i in (1, 2):
        await cluster.create(PODS, pod(f"a{i}", f"10.0.1.{i}", labels={"app": "a"}))
        await cluster.create(PODS, pod(f"b{i}", f"10.0.2.{i}", labels={"app": "b"}))
    await cluster.create(PODS, pod("ab", "10.0.3.1", labels={"app": "a", "tier": "b"}))
    async with Operator(cluster, ScriptedScrape(), "gw-0") as op:
        await cluster.create(POOLS, pool("pa", models=["ma"],
                                         selector={"matchLabels": {"app": "a"}}))
        await cluster.create(POOLS, pool("pb", models=["mb"], selector={"matchExpressions": [
            {"key": "app", "operator": "In", "values": ["b"]}]}))
        await cluster.create(POOLS, pool("pab", models=["mab"], selector={"matchExpressions": [
            {"key": "tier", "operator": "Exists"}]}))
        # A pool reaches the router before its pods do: wait for every member's metrics.
        await eventually(lambda: {n: len(p.workers) for n, p in op.router.pools.items()}
                         == {"pa": 3, "pb": 2, "pab": 1}
                         and all(w.metrics for p in op.router.pools.values()
                                 for w in p.workers.values()))
        assert set(op.route(20, "ma")) <= {"10.0.1.1:8000", "10.0.1.2:8000", "10.0.3.1:8000"}
        assert set(op.route(20, "mb")) == {"10.0.2.1:8000", "10.0.2.2:8000"}
        assert set(op.route(5, "mab")) == {"10.0.3.1:8000"}  # a pod may serve two pools
        # Relabelling a pod moves it between pools.
        await cluster.patch(f"{PODS}/b2", {"metadata": {"labels": {"app": "a"}}})
        await eventually(lambda: "10.0.2.2:8000" in op.workers("pa")
                         and "10.0.2.2:8000" not in op.workers("pb"))
        await cluster.delete(f"{POOLS}/pb")
        await eventually(lambda: "pb" not in op.router.pools)
        with pytest.raises(RequestError) as e:
            op.route(1, "mb")
        assert e.value.status == 404
        assert len(op.workers("pa")) == 4


async def test_not_ready_terminating_and_deleted_pods_get_no_new_requests(
        cluster: Cluster) -> None:
    await three_pods(cluster)
    async with Operator(cluster, ScriptedScrape(), "gw-0") as op:
        await cluster.create(POOLS, pool("p", routing={"policy": "round_robin"}))
        await eventually(lambda: len(op.workers()) == 3 and all(
            w.metrics for w in op.router.pools["p"].workers.values()))
        assert len(op.route(30)) == 3

        await cluster.patch(f"{PODS}/w1", {"status": {"conditions": [
            {"type": "Ready", "status": "False"}]}})
        await eventually(lambda: op.workers()["10.0.0.1:8000"] is False)
        assert set(op.route(30)) == {"10.0.0.2:8000", "10.0.0.3:8000"}

        # Terminating (a finalizer holds it, as kubelet's graceful shutdown would).
        await cluster.patch(f"{PODS}/w2", {"metadata": {
            "finalizers": ["test/hold"], "deletionTimestamp": "2026-12-02T00:00:00Z"}})
        await eventually(lambda: op.workers()["10.0.0.2:8000"] is False)
        assert set(op.route(30)) == {"10.0.0.3:8000"}

        await cluster.delete(f"{PODS}/w3")
        await eventually(lambda: "10.0.0.3:8000" not in op.workers())
        with pytest.raises(RoutingError) as e:
            op.route(1)
        assert e.value.status == 503


async def test_status_is_written_at_a_bounded_rate_with_events(cluster: Cluster) -> None:
    await three_pods(cluster)
    async with Operator(cluster, ScriptedScrape(), "gw-0") as op:
        await cluster.create(POOLS, pool("p"))
        # Under load the pod watch may deliver the third pod after the pool: wait for it.
        await eventually(lambda: cluster.condition("p")["status"] == "True"
                         and cluster.status("p")["workers"] == 3)
        status = cluster.status("p")
        assert status["readyWorkers"] == 3 and status["workers"] == 3
        assert status["staleWorkers"] == 0 and status["observedGeneration"] == 1
        assert status["writer"] == "gw-0"
        assert cluster.condition("p")["reason"] == "WorkersReady"
        assert cluster.condition("p", "Valid")["status"] == "True"
        line = status["workerStatus"][0]
        assert line["pod"] == "w1" and line["address"] == "10.0.0.1:8000"
        assert line["ready"] is True and line["waiting"] == 0 and line["running"] == 1
        assert line["kvUsage"] == 0.25 and line["lastScrape"].endswith("Z")
        # Events are posted by their own task, so the status can be written first.
        joined = await eventually(lambda: len(cluster.events("WorkerJoined")) == 3
                                  and cluster.events("WorkerJoined"))
        assert joined[0]["involvedObject"] == {"apiVersion": API_VERSION, "kind": KIND,
                                               "name": "p", "namespace": NS, "uid": "uid-p"}

        # 20 scrapes per second per worker, yet status patches stay under 1/0.3 s per pool.
        def patches() -> int:
            return len(cluster.requests("PATCH", f"{POOLS}/p/status"))

        before, started = patches(), time.monotonic()
        # The status keeps changing (lastScrape ticks every second), so patches go on...
        await eventually(lambda: patches() > before, what="another status patch")
        # ...but a rate limit is about what does NOT happen, so it needs a window: watch for
        # 1.5 s (an explicit bound) that there is at most one patch per status_min_interval_s
        # since we started counting, plus one, against the time actually elapsed.
        await holds_for(lambda: patches() - before
                        <= (time.monotonic() - started) / FAST.status_min_interval_s + 1,
                        1.5, "at most one status patch per status_min_interval_s")

        await cluster.delete(f"{PODS}/w1")
        await eventually(lambda: cluster.events("WorkerLeft"))
        await eventually(lambda: cluster.status("p")["workers"] == 2)
        assert "w1" in cluster.events("WorkerLeft")[0]["message"]
        assert op.router.pools["p"].spec.name == "p"


async def test_invalid_pools_get_conditions_and_the_operator_carries_on(
        cluster: Cluster) -> None:
    await three_pods(cluster)
    async with Operator(cluster, ScriptedScrape(), "gw-0") as op:
        await cluster.create(POOLS, pool("badpolicy", routing={"policy": "fastest"}))
        await cluster.create(POOLS, pool("nomatch", models=["m2"],
                                         selector={"matchLabels": {"app": "nothing"}}))
        await cluster.create(POOLS, pool("noport", models=["m3"], port="grpc"))
        await cluster.create(POOLS, pool("noselector", models=["m4"], selector={}))
        await cluster.create(POOLS, pool("p"))  # a valid pool still works beside them

        await eventually(lambda: cluster.condition("badpolicy")["reason"] == "UnknownPolicy")
        assert cluster.condition("badpolicy")["status"] == "False"
        assert cluster.condition("badpolicy", "Valid")["status"] == "False"
        assert "fastest" in cluster.condition("badpolicy", "Valid")["message"]
        assert "badpolicy" not in op.router.pools
        await eventually(lambda: cluster.condition("nomatch")["reason"] == "NoMatchingPods")
        await eventually(lambda: cluster.condition("noport")["reason"] == "PortNotFound")
        assert cluster.condition("noport", "Valid")["status"] == "True"
        await eventually(lambda: cluster.condition("noselector")["reason"] == "InvalidSelector")
        await eventually(lambda: cluster.condition("p")["status"] == "True")
        for reason in ("UnknownPolicy", "NoMatchingPods", "PortNotFound", "InvalidSelector"):
            events = await eventually(lambda r=reason: cluster.events(r))
            assert events[0]["type"] == "Warning"

        # Fixing the spec makes the pool routable; breaking it again keeps the last good one.
        await cluster.patch(f"{POOLS}/badpolicy", {"metadata": {"generation": 2}, "spec": {
            "routing": {"policy": "least_loaded"}, "models": ["m5"]}})
        await eventually(lambda: op.router.pools["badpolicy"].spec.policy == "least_loaded")
        await cluster.patch(f"{POOLS}/badpolicy", {"metadata": {"generation": 3}, "spec": {
            "routing": {"policy": "nope"}}})
        await eventually(lambda: cluster.condition("badpolicy", "Valid")["status"] == "False")
        assert op.router.pools["badpolicy"].spec.policy == "least_loaded"
        await eventually(lambda: "previous valid spec" in cluster.events("UnknownPolicy")[-1][
            "message"])

        # Deleting a pool removes it and its workers from the router.
        await cluster.delete(f"{POOLS}/p")
        await eventually(lambda: "p" not in op.router.pools)


async def test_stale_and_failing_scrapes_show_in_status_and_are_avoided(
        cluster: Cluster) -> None:
    scraper = ScriptedScrape()
    await three_pods(cluster)
    async with Operator(cluster, scraper, "gw-0") as op:
        await cluster.create(POOLS, pool("p", scrape={"intervalSeconds": 0.05, "engine": "sim",
                                                      "staleAfterSeconds": 0.3}))
        await eventually(lambda: cluster.status("p").get("readyWorkers") == 3
                         and cluster.status("p")["staleWorkers"] == 0)
        scraper.values["http://10.0.0.1:8000/metrics"] = ConnectionRefusedError("refused")
        await eventually(lambda: cluster.status("p")["staleWorkers"] == 1, timeout=5)
        line = cluster.status("p")["workerStatus"][0]
        assert line["stale"] is True and "refused" in line["scrapeError"]
        assert set(op.route(30)) == {"10.0.0.2:8000", "10.0.0.3:8000"}
        decision = op.router.route(InferenceRequest(model="m1", prompt="x" * 200),
                                   time.time())
        filtered = {c.worker: c.filtered for c in decision.candidates}
        assert filtered["10.0.0.1:8000"] == "not_ready"  # a refused scrape: down at once
        # Every worker failing: Ready=False, MetricsStale, and the router answers 503 (no
        # worker is reachable: not a 429, which would tell clients the pool is busy).
        for i in (2, 3):
            scraper.values[f"http://10.0.0.{i}:8000/metrics"] = TimeoutError()
        await eventually(lambda: cluster.condition("p")["reason"] == "MetricsStale")
        with pytest.raises(RoutingError) as e:
            op.route(1)
        assert e.value.status == 503
        # Recovery.
        scraper.values.clear()
        await eventually(lambda: cluster.condition("p")["status"] == "True")
        await eventually(lambda: cluster.events("PoolReady"))


async def test_api_failures_are_retried(cluster: Cluster) -> None:
    kmock = cluster.kmock
    budget = {"list": 3, "watch": 1, "status": 3, "events": 2}

    def fail(kind: str, status: int) -> Callable[[Any], None]:
        def reaction(_: Any) -> None:
            if budget[kind] > 0:
                budget[kind] -= 1
                raise K.KubernetesError(status=status, reason="Injected", message=kind)
        return reaction

    def gone(_: Any) -> Any:
        if budget["watch"] > 0:
            budget["watch"] -= 1
            return ({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1",
                                                 "code": 410, "reason": "Expired"}},)
        return None

    kmock[K.resource("v1/pods"), K.action.LIST] << fail("list", 500)
    kmock[K.resource("v1/pods"), K.action.WATCH] << gone
    kmock[K.action.UPDATE, K.subresource("status")] << fail("status", 503)
    kmock[K.resource("v1/events"), K.action.CREATE] << fail("events", 500)
    await three_pods(cluster)
    async with Operator(cluster, ScriptedScrape(), "gw-0") as op:
        await cluster.create(POOLS, pool("p"))
        await eventually(lambda: len(op.workers()) == 3)
        await eventually(lambda: cluster.condition("p")["status"] == "True")
        await eventually(lambda: len(cluster.events("WorkerJoined")) == 3)
        assert budget == {"list": 0, "watch": 0, "status": 0, "events": 0}
        # After the 410s the watch still delivers changes.
        await cluster.delete(f"{PODS}/w2")
        await eventually(lambda: "10.0.0.2:8000" not in op.workers())


async def test_watcher_outlives_an_api_outage_and_resync_catches_missed_deletes(
        cluster: Cluster) -> None:
    kmock = cluster.kmock
    down = {"on": True}

    def outage(_: Any) -> None:
        # KMock retires a reaction once it answers None: this one fails until switched off.
        if down["on"]:
            raise K.KubernetesError(status=503, reason="Unavailable", message="down")

    failed = kmock[K.resource("v1/pods"), K.action.LIST] << outage
    await three_pods(cluster)
    await cluster.create(POOLS, pool("p"))
    # Pod listing is down for longer than kopf's own retries (3 here): kopf gives up, the
    # operator restarts it with backoff, and the gateway never sees an exception.
    async with Operator(cluster, ScriptedScrape(), "gw-0") as op:
        await eventually(lambda: len(failed) >= 8)
        assert not op.task.done() and op.workers() == {}
        down["on"] = False
        await eventually(lambda: len(op.workers()) == 3, timeout=10)
        # A pod vanishes without a DELETED event reaching the watch (hard delete in storage):
        # the periodic resync notices.
        del kmock.objects["v1/pods", NS, "w3"]
        await eventually(lambda: "10.0.0.3:8000" not in op.workers())
        await cluster.create(PODS, pod("w4", "10.0.0.4"))
        await eventually(lambda: op.workers().get("10.0.0.4:8000") is True)


async def test_only_the_lease_holder_writes_and_a_successor_takes_over(
        cluster: Cluster) -> None:
    await three_pods(cluster)
    await cluster.create(POOLS, pool("p"))
    a = await Operator(cluster, ScriptedScrape(), "gw-a").__aenter__()
    await eventually(lambda: cluster.status("p").get("writer") == "gw-a")
    async with Operator(cluster, ScriptedScrape(), "gw-b") as b:
        # Both replicas route on their own view...
        await eventually(lambda: len(b.workers()) == 3 and len(a.workers()) == 3,
                         what="both replicas routing to the three pods")
        # ...but only the holder writes status and events.
        def writers() -> set[str]:
            return {r.data["status"]["writer"] for r in cluster.requests(
                "PATCH", f"{POOLS}/p/status")}

        def reporters() -> set[str]:
            return {e["reportingInstance"] for e in cluster.events()}

        await eventually(lambda: len(cluster.events("WorkerJoined")) >= 3,
                         what="gw-a's WorkerJoined Events posted")
        # gw-b writing is what must NOT happen, so watch for it over an explicit window:
        # 0.8 s is 16 of gw-b's status ticks and 8 of its lease retry periods.
        await holds_for(lambda: writers() == {"gw-a"} and reporters() == {"gw-a"}, 0.8,
                        "only the Lease holder gw-a writes status and Events")
        lease = cluster.obj("coordination.k8s.io/v1/leases", "cachepilot-gateway")
        assert lease["spec"]["holderIdentity"] == "gw-a"
        # The holder stops (and releases the lease): the other takes over.
        await a.__aexit__(None, None, None)
        await eventually(lambda: cluster.obj("coordination.k8s.io/v1/leases",
                                             "cachepilot-gateway")["spec"]["holderIdentity"]
                         == "gw-b")
        await cluster.delete(f"{PODS}/w1")
        await eventually(lambda: cluster.status("p").get("writer") == "gw-b"
                         and cluster.status("p")["workers"] == 2)
        await eventually(lambda: any(e["reportingInstance"] == "gw-b"
                                     for e in cluster.events("WorkerLeft")))


async def test_cancelling_the_operator_stops_kopf_and_releases_the_lease(
        cluster: Cluster) -> None:
    await three_pods(cluster)
    op = await Operator(cluster, ScriptedScrape(), "gw-0").__aenter__()
    await cluster.create(POOLS, pool("p"))
    await eventually(lambda: cluster.status("p").get("writer") == "gw-0")
    assert any(t.name == "kopf" for t in threading.enumerate())
    op.task.cancel()  # what a gateway does if it cancels its tasks instead of stop_flag
    with pytest.raises(asyncio.CancelledError):
        await op.task
    assert not any(t.name == "kopf" for t in threading.enumerate())
    lease = cluster.obj("coordination.k8s.io/v1/leases", "cachepilot-gateway")
    assert not lease["spec"].get("holderIdentity")


async def test_operator_writes_nothing_to_pods_or_pool_specs(cluster: Cluster) -> None:
    await three_pods(cluster)
    async with Operator(cluster, ScriptedScrape(), "gw-0"):
        await cluster.create(POOLS, pool("p"))
        await eventually(lambda: cluster.condition("p")["status"] == "True")
    before = [r for r in cluster.kmock if r.method.value in ("PATCH", "PUT", "POST", "DELETE")]
    written = {(r.method.value, r.url.path) for r in before}
    allowed_prefixes = (f"{POOLS}/p/status", EVENTS, LEASES)
    ours = {w for w in written if w[1].startswith(allowed_prefixes)}
    test_writes = {("POST", PODS), ("POST", POOLS)}
    assert written - ours == test_writes
