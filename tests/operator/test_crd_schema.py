"""The CachePilotPool CRD: one generated source, a structural schema whose defaults are the
router's, and the operator's parser agreeing with it on valid and invalid pools."""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from cachepilot.core import BlockConfig, CostModel, PoolSpec, Weights
from cachepilot.operator import crd
from cachepilot.operator.spec import (
    InvalidSpec,
    parse_pool,
    parse_selector,
    pod_view,
    resolve_port,
)

from helpers.paths import ROOT
from helpers.schemas import rejected, to_jsonschema, validate_pool

SAMPLE = ROOT / "manifests" / "sample-pool.yaml"


def sample() -> dict[str, Any]:
    return yaml.safe_load(SAMPLE.read_text())


def test_crd_is_valid_for_kubernetes_and_names_the_resource() -> None:
    doc = yaml.safe_load(crd.render_yaml())
    kubernetes_validate.validate(doc, "1.30.0", strict=True)
    spec = doc["spec"]
    assert doc["metadata"]["name"] == f"{crd.PLURAL}.{crd.GROUP}"
    assert spec["scope"] == "Namespaced" and spec["names"]["shortNames"] == ["cpool"]
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Ready"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns["Workers"] == ".status.readyWorkers"


def _walk(node: dict[str, Any], path: str = "") -> list[str]:
    """Structural-schema rules the API server enforces: a type everywhere (or int-or-string),
    and every default valid against its own node."""
    problems = []
    if "type" not in node and not node.get("x-kubernetes-int-or-string"):
        problems.append(f"{path or '/'} has no type")
    if "default" in node:
        try:
            jsonschema.Draft7Validator(to_jsonschema(node)).validate(node["default"])
        except jsonschema.ValidationError as e:
            problems.append(f"{path}: default invalid: {e.message}")
    for key, child in (node.get("properties") or {}).items():
        problems += _walk(child, f"{path}/{key}")
    if isinstance(node.get("items"), dict):
        problems += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        problems += _walk(node["additionalProperties"], f"{path}{{}}")
    return problems


def test_schema_is_structural_and_defaults_are_the_routers() -> None:
    version = crd.crd_manifest()["spec"]["versions"][0]
    assert _walk(version["schema"]["openAPIV3Schema"]) == []
    props = crd.spec_schema()["properties"]
    routing = props["routing"]["properties"]
    assert routing["policy"]["default"] == PoolSpec().policy
    assert routing["blockSize"]["default"] == BlockConfig().block_size
    assert {k: v["default"] for k, v in routing["weights"]["properties"].items()} == \
        Weights().to_dict()
    cost = routing["cost"]["properties"]
    assert cost["prefillMsPerToken"]["default"] == CostModel().prefill_ms_per_token
    assert cost["admissionLimit"]["type"] == "integer"
    assert props["capacityBlocks"]["default"] == PoolSpec().capacity_blocks
    assert props["scrape"]["properties"]["engine"]["enum"] == ["vllm", "sglang", "llamacpp", "sim"]


def test_sample_pool_validates_and_parses_to_the_routers_spec() -> None:
    body = sample()
    validate_pool(body)
    config = parse_pool("sim", body)
    assert config.spec.models == ("sim-llama-8b",)
    assert config.spec.policy == "priced" and config.port == "http"
    assert config.scrape.engine == "sim" and config.scrape.interval_s == 0.25
    assert config.scrape.stale_after_s == max(CostModel().stale_after_s, 0.75)
    assert config.spec.cost.stale_after_s == config.scrape.stale_after_s


def test_minimal_pool_gets_the_defaults() -> None:
    body = {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": "m"},
            "spec": {"selector": {"matchLabels": {"a": "b"}}, "port": 8000}}
    validate_pool(body)
    config = parse_pool("m", body)
    assert config.spec == PoolSpec(name="m", cost=CostModel())
    assert config.scrape.engine == "vllm" and config.scrape.path == "/metrics"


@pytest.mark.parametrize(("change", "schema_rejects", "reason"), [
    ({"routing": {"policy": "fastest"}}, False, "UnknownPolicy"),  # only the gateway knows
    # A peer model exists only in the simulator: never valid for a live pool.
    ({"routing": {"policy": "sglang_cache_aware"}}, False, "UnknownPolicy"),
    ({"scrape": {"engine": "tgi"}}, True, "UnknownEngine"),
    ({"port": 70000}, False, "InvalidPort"),  # int-or-string: the operator checks the range
    ({"port": True}, True, "InvalidPort"),
    ({"selector": {}}, True, "InvalidSelector"),
    ({"selector": {"matchExpressions": [{"key": "a", "operator": "In"}]}}, False,
     "InvalidSelector"),
    ({"routing": {"blockSize": 0}}, True, "InvalidSpec"),
    ({"routing": {"weights": {"kv": -1}}}, True, "InvalidSpec"),
    ({"scrape": {"path": "metrics"}}, True, "InvalidSpec"),
    ({"scrape": {"intervalSeconds": 0}}, True, "InvalidSpec"),
    ({"capacityBlocks": 0}, True, "InvalidSpec"),
    ({"models": [""]}, True, "InvalidSpec"),
])
def test_invalid_pools(change: dict[str, Any], schema_rejects: bool, reason: str) -> None:
    body = sample()
    body["spec"] = {**copy.deepcopy(body["spec"]), **change}
    got = rejected(body, validate_pool, lambda b: parse_pool("sim", b),
                   schema_rejects=schema_rejects)
    assert got == reason


def test_missing_selector_is_rejected_by_both() -> None:
    body = sample()
    del body["spec"]["selector"]
    with pytest.raises(jsonschema.ValidationError):
        validate_pool(body)
    with pytest.raises(InvalidSpec):
        parse_pool("sim", body)


def test_label_selector_semantics() -> None:
    sel = parse_selector({"matchLabels": {"app": "llm"}, "matchExpressions": [
        {"key": "tier", "operator": "In", "values": ["a", "b"]},
        {"key": "canary", "operator": "DoesNotExist"},
        {"key": "zone", "operator": "NotIn", "values": ["z9"]},
        {"key": "gpu", "operator": "Exists"}]})
    assert sel.matches({"app": "llm", "tier": "a", "gpu": "h100"})
    assert sel.matches({"app": "llm", "tier": "b", "gpu": "", "zone": "z1"})
    assert not sel.matches({"app": "llm", "tier": "c", "gpu": "x"})
    assert not sel.matches({"app": "llm", "tier": "a", "gpu": "x", "canary": "1"})
    assert not sel.matches({"app": "llm", "tier": "a", "gpu": "x", "zone": "z9"})
    assert not sel.matches({"app": "llm", "tier": "a"})
    assert not sel.matches(None)


def test_pod_readiness_and_port_resolution() -> None:
    body = {"metadata": {"name": "p", "labels": {"a": "b"}},
            "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8000},
                                               {"name": "metrics", "containerPort": 9000}]}]},
            "status": {"podIP": "10.1.2.3", "phase": "Running",
                       "conditions": [{"type": "Ready", "status": "True"}]}}
    pod = pod_view(body)
    assert pod.ready and pod.ip == "10.1.2.3"
    assert resolve_port("http", pod) == 8000 and resolve_port("metrics", pod) == 9000
    assert resolve_port(7000, pod) == 7000
    assert resolve_port(None, pod) is None  # two ports: ambiguous
    assert resolve_port("grpc", pod) is None
    terminating = copy.deepcopy(body)
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert not pod_view(terminating).ready and pod_view(terminating).terminating
    no_ip = copy.deepcopy(body)
    del no_ip["status"]["podIP"]
    assert not pod_view(no_ip).ready
    failed = copy.deepcopy(body)
    failed["status"]["phase"] = "Failed"
    assert not pod_view(failed).ready
    unready = copy.deepcopy(body)
    unready["status"]["conditions"][0]["status"] = "False"
    assert not pod_view(unready).ready
