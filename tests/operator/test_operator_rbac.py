"""Least privilege, checked by behaviour: run the real operator against KMock through every
path it has (watch, resync, scrape, status, Events, Lease take-over and release), record
each API request it makes, and require the chart's Role to allow each one, and to allow
nothing the operator never used."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import helm_python as helm
import kmock as K
import pytest
import yaml

from cachepilot.operator import inferencepool as ip

from helpers.kube import (
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
    three_pods,
    vllm_pod,
)
from helpers.paths import ROOT
from helpers.polling import eventually
from helpers.schemas import infpool

CHART = ROOT / "charts" / "cachepilot"
DISCOVERY = re.compile(r"^/(api|apis)(/[^/]+){0,2}/?$")
RESOURCE = re.compile(r"^/(?:api/(?P<core>v1)|apis/(?P<group>[^/]+)/[^/]+)"
                      r"/namespaces/(?P<ns>[^/]+)/(?P<res>[^/]+)(?:/(?P<name>[^/]+))?"
                      r"(?:/(?P<sub>[^/]+))?$")


@pytest.fixture
async def cluster(kmock: K.KubernetesEmulator) -> AsyncIterator[Cluster]:
    """The operator tests' cluster, with InferencePools too."""
    async with open_cluster(kmock, inference_pools=True) as c:
        yield c


def rbac_request(method: str, path: str, query: dict[str, str]) -> tuple[str, str, str, str]:
    m = RESOURCE.match(path)
    assert m, f"unexpected API path {path}"
    group = "" if m["core"] else m["group"]
    resource = m["res"] + (f"/{m['sub']}" if m["sub"] else "")
    name = m["name"] or ""
    verb = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}.get(method)
    if verb is None:
        verb = "watch" if query.get("watch") in ("true", "1") else ("get" if name else "list")
    assert m["ns"] == NS
    return group, resource, verb, name


def allowed(rules: list[dict[str, Any]], req: tuple[str, str, str, str]) -> bool:
    group, resource, verb, name = req
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"]
               and (not r.get("resourceNames") or name in r["resourceNames"]) for r in rules)


def pod_lists(c: Cluster) -> list[Any]:
    """Pod LISTs (not watches) the API served."""
    return [r for r in c.requests("GET", PODS)
            if r.url.path == PODS and r.url.query.get("watch") not in ("true", "1")]


@pytest.mark.parametrize("epp", [False, True], ids=["default", "epp"])
async def test_role_allows_exactly_what_the_operator_does(cluster: Cluster,
                                                          epp: bool) -> None:
    values = {"epp": {"enabled": True}} if epp else None
    rendered = helm.Chart.load(CHART).render(values, name="cp", namespace=NS)
    role = next(d for d in yaml.safe_load_all(rendered["cachepilot/templates/rbac.yaml"])
                if d["kind"] == "Role")
    lease_name = role["rules"][-1]["resourceNames"][0]
    # The chart creates the Lease; so does this "helm install".
    lease = yaml.safe_load(rendered["cachepilot/templates/lease.yaml"])
    await cluster.create(f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases", lease)
    # The operator gets the EPP Service's name as the chart's Deployment passes it.
    gateway_args = yaml.safe_load(rendered["cachepilot/templates/deployment.yaml"])[
        "spec"]["template"]["spec"]["containers"][0]["args"]
    epp_service = next((a.split("=", 1)[1] for a in gateway_args
                        if a.startswith("--epp-service=")), None)
    assert (epp_service is not None) == epp
    options = Operator.default_options(lease_name=lease_name, epp_service=epp_service)
    test_paths = {("POST", PODS), ("POST", POOLS), ("DELETE", f"{PODS}/w1"),
                  ("POST", INFPOOLS),
                  ("POST", f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases")}
    await three_pods(cluster)
    async with Operator(cluster, ScriptedScrape(), "gw-a", options) as a:
        await cluster.create(POOLS, pool("p"))
        await eventually(lambda: cluster.condition("p")["status"] == "True")
        if epp:  # an InferencePool naming the chart's EPP Service becomes a pool
            await cluster.create(PODS, vllm_pod("v1", "10.0.1.1", ports=(8000,)))
            await cluster.create(INFPOOLS, infpool("llama", picker=epp_service))
            await eventually(lambda: ip.router_pool_name("llama") in a.router.pools)
        async with Operator(cluster, ScriptedScrape(), "gw-b", options):
            await cluster.delete(f"{PODS}/w1")
            await cluster.create(PODS, pod("w4", "10.0.0.4"))
            await eventually(lambda: cluster.status("p").get("workers") == 3)
            await a.__aexit__()  # releases the lease; gw-b takes over
            await eventually(lambda: cluster.status("p").get("writer") == "gw-b",
                             what="gw-b writing the status after the take-over")
            # gw-b's periodic resync relists pools, then pods; kopf lists only at (re)start.
            listed = len(pod_lists(cluster))
            await eventually(lambda: len(pod_lists(cluster)) > listed,
                             what="a resync round by gw-b (a pod LIST after the take-over)")
    used = set()
    for r in cluster.kmock:
        path = r.url.path
        if DISCOVERY.match(path) or (r.method.value, path) in test_paths:
            continue
        used.add(rbac_request(r.method.value, path, dict(r.url.query)))
    denied = {u for u in used if not allowed(role["rules"], u)}
    assert denied == set()
    # Every rule is needed: each (group, resource, verb) granted was used.
    granted = {(g, res, v) for rule in role["rules"] for g in rule["apiGroups"]
               for res in rule["resources"] for v in rule["verbs"]}
    assert granted == {(g, res, v) for g, res, v, _ in used}
