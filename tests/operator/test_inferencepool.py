"""InferencePools as a source of workers, KV-event endpoints and the CachePilotPool's new
fields: the vendored upstream CRD, the operator's parser agreeing with it, and pure
resolution of pods into workers and KV-event publishers."""

from __future__ import annotations

import copy
import re
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from cachepilot.datalayer.kv_events import Endpoints
from cachepilot.operator import crd
from cachepilot.operator import inferencepool as ip
from cachepilot.operator.spec import (
    InvalidSpec,
    WorkerSource,
    kv_event_endpoints,
    parse_pool,
    pod_view,
)

from helpers.schemas import (
    VENDORED,
    infpool,
    rejected,
    validate_inference_pool,
    validate_pool,
    vendored_crd,
)


def test_the_vendored_crd_is_upstreams_v1_and_says_where_it_came_from() -> None:
    header = VENDORED.read_text().split("apiVersion:", 1)[0]
    assert re.search(r"commit: [0-9a-f]{40}", header)
    assert "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml" in header
    doc = vendored_crd()
    kubernetes_validate.validate(doc, "1.30.0", strict=True)
    assert doc["metadata"]["name"] == f"{ip.PLURAL}.{ip.GROUP}"
    assert doc["spec"]["names"]["kind"] == ip.KIND
    v1 = next(v for v in doc["spec"]["versions"] if v["name"] == "v1")
    assert v1["served"] and v1["storage"] and v1["subresources"] == {"status": {}}


def test_inference_pools_parse_as_the_schema_validates() -> None:
    body = infpool(ports=(8000, 8001))
    validate_inference_pool(body)
    view = ip.parse(body)
    assert view.source.ports == (8000, 8001)
    assert view.source.selector.matches({"app": "vllm"})
    assert view.picker == ip.PickerRef(group="", kind="Service", name="cp-cachepilot-epp",
                                       port=9002, failure_mode="FailClose")
    assert view.picked_by("cp-cachepilot-epp") and not view.picked_by("other-epp")
    # Upstream's defaults apply when group and kind are omitted; any other kind is not ours.
    other = infpool(endpointPickerRef={"group": "example.com", "kind": "Picker",
                                       "name": "cp-cachepilot-epp"})
    validate_inference_pool(other)
    assert not ip.parse(other).picked_by("cp-cachepilot-epp")
    unpicked = infpool(picker=None)
    validate_inference_pool(unpicked)
    assert ip.parse(unpicked).picker is None and not ip.parse(unpicked).picked_by("x")


@pytest.mark.parametrize(("spec", "schema_rejects", "reason"), [
    ({"targetPorts": []}, True, "InvalidPort"),
    ({"targetPorts": [{"number": 70000}]}, True, "InvalidPort"),
    ({"targetPorts": [{"number": p} for p in range(8000, 8009)]}, True, "InvalidPort"),
    # Upstream's CEL rules (the API server runs them; jsonschema cannot): our parser does.
    ({"targetPorts": [{"number": 8000}, {"number": 8000}]}, False, "InvalidPort"),
    ({"endpointPickerRef": {"name": "cp-cachepilot-epp"}}, False, "InvalidExtensionRef"),
    ({"selector": {"matchLabels": {}}}, True, "InvalidSelector"),
])
def test_invalid_inference_pools(spec: dict[str, Any], schema_rejects: bool,
                                 reason: str) -> None:
    body = infpool(**spec)
    assert rejected(body, validate_inference_pool, ip.parse,
                    schema_rejects=schema_rejects) == reason


def cpool(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
            "metadata": {"name": "tuned", "generation": 3}, "spec": spec}


def test_a_cachepilot_pool_takes_its_workers_from_an_inference_pool() -> None:
    body = cpool(inferencePoolRef={"name": "llama"}, models=["llama-3"],
                 routing={"policy": "least_loaded", "weights": {"kv": 2}})
    validate_pool(body)
    unresolved = parse_pool("tuned", body)
    assert unresolved.inference_pool == "llama" and unresolved.source is None
    source = ip.parse(infpool(ports=(8000, 8001))).source
    config = parse_pool("tuned", body, source=source)
    assert config.source == source and config.source.ports == (8000, 8001)
    assert config.spec.policy == "least_loaded" and config.spec.weights.kv == 2
    assert config.spec.models == ("llama-3",) and config.generation == 3
    # The same parser builds a pool from an InferencePool alone: the router's defaults.
    alone = parse_pool(ip.router_pool_name("llama"),
                       {"spec": {"inferencePoolRef": {"name": "llama"}}}, source=source)
    assert alone.spec.name == "inferencepool/llama" and alone.spec.policy == "priced"


@pytest.mark.parametrize("spec", [
    {"inferencePoolRef": {"name": "llama"}, "selector": {"matchLabels": {"a": "b"}}},
    {"inferencePoolRef": {"name": "llama"}, "port": 8000, "selector": {"matchLabels": {}}},
    {"port": 8000},  # neither selector nor inferencePoolRef
])
def test_selector_and_inference_pool_ref_exclude_each_other(spec: dict[str, Any]) -> None:
    with pytest.raises(jsonschema.ValidationError):
        validate_pool(cpool(**spec))
    with pytest.raises(InvalidSpec):
        parse_pool("tuned", cpool(**spec))


def test_an_empty_inference_pool_ref_is_rejected_by_both() -> None:
    body = cpool(inferencePoolRef={"name": ""})
    with pytest.raises(jsonschema.ValidationError):
        validate_pool(body)
    with pytest.raises(InvalidSpec, match=r"inferencePoolRef\.name"):
        parse_pool("tuned", body)


def pod(annotations: dict[str, str] | None = None, ip_: str = "10.1.2.3") -> Any:
    return pod_view({
        "metadata": {"name": "w", "labels": {"app": "vllm"}, "annotations": annotations or {}},
        "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8000},
                                           {"name": "kv", "containerPort": 5557}]}]},
        "status": {"podIP": ip_, "phase": "Running",
                   "conditions": [{"type": "Ready", "status": "True"}]}})


def kv_config(**kv: Any) -> Any:
    body = cpool(selector={"matchLabels": {"app": "vllm"}}, port="http", kvEvents=kv)
    validate_pool(body)
    return parse_pool("tuned", body).kv_events


def test_kv_events_on_a_fixed_port_with_replay_on_the_next() -> None:
    cfg = kv_config(port=5557)
    assert cfg.topic == "kv-events" and cfg.replay
    assert kv_event_endpoints(cfg, pod()) == Endpoints("tcp://10.1.2.3:5557",
                                                       "tcp://10.1.2.3:5558", "kv-events")
    named = kv_config(port="kv", replayPort=6000, topic="t")
    assert kv_event_endpoints(named, pod()) == Endpoints("tcp://10.1.2.3:5557",
                                                         "tcp://10.1.2.3:6000", "t")
    no_replay = kv_config(port=5557, replay=False)
    assert kv_event_endpoints(no_replay, pod()) == Endpoints("tcp://10.1.2.3:5557", None,
                                                             "kv-events")
    assert kv_event_endpoints(cfg, pod(ip_="fd00::5")) == Endpoints(
        "tcp://[fd00::5]:5557", "tcp://[fd00::5]:5558", "kv-events")
    assert kv_event_endpoints(kv_config(port="grpc"), pod()) is None  # no such port name


def test_kv_events_from_a_pod_annotation() -> None:
    cfg = kv_config(portAnnotation="cachepilot.io/kv-events-port")
    assert kv_event_endpoints(cfg, pod({"cachepilot.io/kv-events-port": "7000"})) == \
        Endpoints("tcp://10.1.2.3:7000", "tcp://10.1.2.3:7001", "kv-events")
    assert kv_event_endpoints(cfg, pod({"cachepilot.io/kv-events-port": "kv"})).events == \
        "tcp://10.1.2.3:5557"
    # A pod that does not say, or says nonsense, is followed approximately; never an error.
    assert kv_event_endpoints(cfg, pod()) is None
    assert kv_event_endpoints(cfg, pod({"cachepilot.io/kv-events-port": "99999"})) is None
    assert kv_event_endpoints(cfg, pod({"cachepilot.io/kv-events-port": ""})) is None


@pytest.mark.parametrize(("kv", "schema_rejects"), [
    ({}, False),  # neither port nor annotation
    ({"port": 5557, "portAnnotation": "a/b"}, False),  # both
    ({"port": 0}, False),
    ({"port": 5557, "replay": "yes"}, True),
    ({"port": 5557, "topic": 7}, True),
    ({"portAnnotation": ""}, True),
])
def test_invalid_kv_events(kv: dict[str, Any], schema_rejects: bool) -> None:
    body = cpool(selector={"matchLabels": {"app": "vllm"}}, kvEvents=kv)
    reason = rejected(body, validate_pool, lambda b: parse_pool("tuned", b),
                      schema_rejects=schema_rejects)
    assert reason in ("InvalidSpec", "InvalidPort")


def test_vllm_hash_seed_reaches_the_block_config() -> None:
    body = cpool(selector={"matchLabels": {"app": "vllm"}},
                 routing={"blockSize": 32, "vllmHashSeed": "0"})
    validate_pool(body)
    block = parse_pool("tuned", body).spec.block
    assert (block.block_size, block.vllm_seed) == (32, "0")
    assert parse_pool("tuned", cpool(selector={"matchLabels": {"a": "b"}})).spec.block \
        .vllm_seed is None
    bad = copy.deepcopy(body)
    bad["spec"]["routing"]["vllmHashSeed"] = 0
    with pytest.raises(jsonschema.ValidationError):
        validate_pool(bad)
    with pytest.raises(InvalidSpec, match="vllmHashSeed"):
        parse_pool("tuned", bad)


def test_worker_source_ports_keep_their_order() -> None:
    source = ip.parse(infpool(ports=(8002, 8000, 8001))).source
    assert isinstance(source, WorkerSource) and source.ports == (8002, 8000, 8001)
