"""Flow control's Kubernetes side: InferenceObjectives name the priority bands (the real kopf
operator against KMock), and a CachePilotPool's spec.flowControl sets its pool's flow
control."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import kmock as K
import pytest

from cachepilot.core.flow.config import FlowConfig
from cachepilot.operator import objectives as obj
from cachepilot.operator.crd import GROUP, KIND, PLURAL, VERSION
from cachepilot.operator.spec import InvalidSpec, parse_pool

from helpers.kube import NS, POOLS, Cluster, Operator, pool
from helpers.polling import eventually

pytestmark = pytest.mark.timeout(60)

OBJECTIVES = f"/apis/{obj.GROUP}/{obj.VERSION}/namespaces/{NS}/{obj.PLURAL}"


def objective(name: str, priority: int | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"poolRef": {"name": "llama"}}
    if priority is not None:
        spec["priority"] = priority
    return {"apiVersion": f"{obj.GROUP}/{obj.VERSION}", "kind": obj.KIND,
            "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}"}, "spec": spec}


@pytest.fixture
async def cluster(kmock: K.KubernetesEmulator) -> AsyncIterator[Cluster]:
    import aiohttp

    kmock.resources.load_bundled()
    verbs = {"get", "list", "watch", "create", "patch", "update", "delete"}
    kmock.resources[f"{GROUP}/{VERSION}/{PLURAL}"] = K.ResourceInfo(
        kind=KIND, namespaced=True, subresources={"status"}, verbs=verbs)
    kmock.resources[f"{obj.GROUP}/{obj.VERSION}/{obj.PLURAL}"] = K.ResourceInfo(
        kind=obj.KIND, namespaced=True, verbs=verbs)
    async with aiohttp.ClientSession() as http:
        yield Cluster(kmock, http)


async def test_inference_objectives_set_the_priority_bands(cluster: Cluster) -> None:
    table: dict[str, int] = {}
    options = Operator.default_options(objectives_group=obj.GROUP)
    async with Operator(cluster, None, "gw-0", options, objectives=table):
        await cluster.create(OBJECTIVES, objective("critical", 10))
        await cluster.create(OBJECTIVES, objective("batch", -1))
        await cluster.create(OBJECTIVES, objective("plain", None))  # no priority: 0
        await eventually(lambda: table == {"critical": 10, "batch": -1, "plain": 0},
                         what="the objectives' priorities")
        await cluster.patch(f"{OBJECTIVES}/batch", {"spec": {"priority": -5}})
        await eventually(lambda: table.get("batch") == -5, what="a changed priority")
        await cluster.delete(f"{OBJECTIVES}/critical")
        await eventually(lambda: "critical" not in table, what="a deleted objective")


async def test_a_pools_flow_control_settings_reach_its_router_pool(cluster: Cluster) -> None:
    async with Operator(cluster, None, "gw-0") as op:
        await cluster.create(POOLS, pool("p", flowControl={"holdDepth": 0, "ttlSeconds": 5,
                                                           "fairness": "fcfs"}))
        await eventually(lambda: "p" in op.router.pools, what="the pool")
        flow = op.router.pools["p"].spec.flow
        assert flow == FlowConfig(hold_depth=0, ttl_s=5.0, fairness="fcfs")


def test_flow_control_settings_are_validated() -> None:
    assert parse_pool("p", pool("p")).spec.flow is None  # the gateway's settings apply
    off = parse_pool("p", pool("p", flowControl={"enabled": False})).spec.flow
    assert off is not None and not off.enabled
    for bad in ({"holdDepth": 1.5}, {"fairness": "random"}, {"ttlSeconds": -1},
                {"enabled": "yes"}):
        with pytest.raises(InvalidSpec):
            parse_pool("p", pool("p", flowControl=bad))


def test_objective_priority_defaults_to_zero() -> None:
    assert obj.priority_of(objective("x", None)) == 0
    assert obj.priority_of({"spec": {"priority": True}}) == 0
    assert obj.priority_of(objective("x", -2)) == -2
