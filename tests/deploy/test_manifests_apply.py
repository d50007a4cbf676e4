"""manifests/: every object valid for Kubernetes (built-in kinds against Kubernetes' schemas,
CachePilotPools against the CRD, InferencePools against upstream's vendored CRD, Gateway API
objects against upstream's CRDs), consistent with each other, and applied with the real
``kubectl apply`` (client dry-run, then for real) against KMock's API emulator, where an
applied InferencePool makes the real operator build its pool."""

from __future__ import annotations

import asyncio
import copy
import json
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import kmock as K
import kopf
import kubernetes_validate
import pytest
import yaml

from cachepilot.cli.worker import sim_worker_cmd
from cachepilot.core import Router
from cachepilot.operator import OperatorOptions, crd, run_operator
from cachepilot.operator import inferencepool as ip
from cachepilot.operator.spec import kv_event_endpoints, parse_pool, pod_view, resolve_port

from helpers.paths import ROOT
from helpers.polling import eventually
from helpers.schemas import to_jsonschema, validate_inference_pool, validate_pool

MANIFESTS = sorted((ROOT / "manifests").glob("*.yaml"))
NS = "serving"


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_docs() -> list[dict[str, Any]]:
    return [d for p in MANIFESTS for d in docs(p)]


def find(kind: str, name: str) -> dict[str, Any]:
    return next(d for d in all_docs() if d["kind"] == kind and d["metadata"]["name"] == name)


GATEWAY_API = ROOT / "tests" / "data" / "gateway-api"  # upstream's CRDs, vendored for tests


def test_the_expected_files_exist() -> None:
    assert {p.name for p in MANIFESTS} == {"crd.yaml", "sample-pool.yaml", "sim-workers.yaml",
                                           "vllm-example.yaml", "gateway-api-istio.yaml"}


def validate_gateway_api(doc: dict[str, Any]) -> None:
    """A Gateway API object against its vendored CRD's schema for its version."""
    plural = {"Gateway": "gateways", "HTTPRoute": "httproutes"}[doc["kind"]]
    crd_doc = yaml.safe_load((GATEWAY_API / f"{plural}.yaml").read_text())
    version = doc["apiVersion"].split("/")[1]
    (v,) = [v for v in crd_doc["spec"]["versions"] if v["name"] == version]
    jsonschema.Draft7Validator(to_jsonschema(v["schema"]["openAPIV3Schema"])).validate(doc)


def validate_any(doc: dict[str, Any]) -> None:
    if doc["kind"] == crd.KIND:
        validate_pool(doc)
        parse_pool(doc["metadata"]["name"], doc)
    elif doc["kind"] == ip.KIND:
        validate_inference_pool(doc)
        ip.parse(doc)
    elif doc["kind"] in ("Gateway", "HTTPRoute"):
        validate_gateway_api(doc)
    else:
        kubernetes_validate.validate(doc, "1.30.0", strict=True)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_object_is_valid(path: Path) -> None:
    for doc in docs(path):
        validate_any(doc)


def test_the_gateway_api_check_does_catch_mistakes() -> None:
    route = copy.deepcopy(find("HTTPRoute", "llm"))
    route["spec"]["rules"][0]["backendRefs"][0]["kind"] = "Inference Pool"
    with pytest.raises(jsonschema.ValidationError):
        validate_gateway_api(route)


def pod_of(deployment: dict[str, Any]) -> dict[str, Any]:
    """What a pod of this Deployment looks like once running and Ready."""
    template = deployment["spec"]["template"]
    return {"metadata": {"name": "x", **template["metadata"]}, "spec": template["spec"],
            "status": {"podIP": "10.0.0.1", "phase": "Running",
                       "conditions": [{"type": "Ready", "status": "True"}]}}


@pytest.mark.parametrize(("pool_name", "deployment_name"), [
    ("sim", "cachepilot-sim-worker"), ("llama", "vllm-llama")])
def test_pools_select_their_workers_and_find_the_port(pool_name: str,
                                                      deployment_name: str) -> None:
    config = parse_pool(pool_name, find(crd.KIND, pool_name))
    deployment = find("Deployment", deployment_name)
    pod = pod_view(pod_of(deployment))
    assert config.selector.matches(pod.labels)
    assert resolve_port(config.port, pod) == 8000
    assert pod.ready


def test_sim_workers_run_the_real_command_with_valid_flags() -> None:
    container = find("Deployment", "cachepilot-sim-worker")["spec"]["template"]["spec"][
        "containers"][0]
    assert container["command"] == ["cachepilot"]
    args = container["args"]
    assert args[0] == "sim-worker"
    ctx = sim_worker_cmd.make_context("sim-worker", list(args[1:]))
    assert ctx.params["host"] == "0.0.0.0" and ctx.params["port"] == 8000
    pool = parse_pool("sim", find(crd.KIND, "sim"))
    assert pool.spec.models == (ctx.params["model"],)
    assert pool.scrape.engine == "sim"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"


def test_vllm_example_matches_the_pool() -> None:
    pool = parse_pool("llama", find(crd.KIND, "llama"))
    container = find("Deployment", "vllm-llama")["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert f"--served-model-name={pool.spec.models[0]}" in args
    assert f"--block-size={pool.spec.block.block_size}" in args
    assert f"--max-num-seqs={pool.spec.cost.max_batch}" in args  # vLLM does not export it
    assert isinstance(pool.spec.cost.max_batch, int)
    assert pool.scrape.engine == "vllm"
    # KV events: the flag vLLM reads, and the pool finds the publisher and its replay.
    flag = next(a for a in args if a.startswith("--kv-events-config="))
    kv = json.loads(flag.split("=", 1)[1])
    assert kv["enable_kv_cache_events"] is True and kv["publisher"] == "zmq"
    assert "--prefix-caching-hash-algo=sha256_cbor" in args
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PYTHONHASHSEED"] == pool.spec.block.vllm_seed
    assert pool.kv_events is not None
    endpoints = kv_event_endpoints(pool.kv_events, pod_view(pod_of(find("Deployment",
                                                                        "vllm-llama"))))
    assert endpoints is not None
    assert endpoints.events == kv["endpoint"].replace("*", "10.0.0.1")
    assert endpoints.replay == kv["replay_endpoint"].replace("*", "10.0.0.1")
    assert endpoints.topic == kv["topic"]


def test_the_gateway_example_routes_to_an_inference_pool_we_pick_for() -> None:
    gateway, route = find("Gateway", "inference-gateway"), find("HTTPRoute", "llm")
    assert route["spec"]["parentRefs"][0]["name"] == gateway["metadata"]["name"]
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    assert (backend["group"], backend["kind"]) == (ip.GROUP, ip.KIND)
    view = ip.parse(find(ip.KIND, backend["name"]))
    # The chart's EPP Service (release "cp", epp.enabled) and port, as docs/gateway-api.md
    # installs it; test_chart_render checks the chart renders exactly that name and port.
    assert view.picked_by("cp-cachepilot-epp") and view.picker.port == 9002
    # It selects the vLLM example's pods and finds their serving port.
    pod = pod_view(pod_of(find("Deployment", "vllm-llama")))
    assert view.source.selector.matches(pod.labels)
    assert [resolve_port(p, pod) for p in view.source.ports] == [8000]


KUBECTL = shutil.which("kubectl")
VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}


class Kubectl:
    """The real kubectl against KMock, with every resource the manifests use registered."""

    def __init__(self, kmock: K.KubernetesEmulator, tmp_path: Path) -> None:
        kmock.resources.load_bundled()
        for group_version, plural, kind, shortnames in (
                (f"{crd.GROUP}/{crd.VERSION}", crd.PLURAL, crd.KIND, set(crd.SHORT_NAMES)),
                (ip.API_VERSION, ip.PLURAL, ip.KIND, {"infpool"}),
                ("gateway.networking.k8s.io/v1", "gateways", "Gateway", set()),
                ("gateway.networking.k8s.io/v1", "httproutes", "HTTPRoute", set())):
            kmock.resources[f"{group_version}/{plural}"] = K.ResourceInfo(
                kind=kind, namespaced=True, subresources={"status"}, shortnames=shortnames,
                verbs=VERBS)
        self.url = str(kmock.url).rstrip("/")
        self.kubeconfig = tmp_path / "kubeconfig"
        self.kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "u",
                                                       "namespace": NS}}]}))

    async def __call__(self, *args: str) -> str:
        assert KUBECTL is not None
        proc = await asyncio.create_subprocess_exec(
            KUBECTL, f"--kubeconfig={self.kubeconfig}", *args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        async with asyncio.timeout(60):
            out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        return out.decode()


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed")
async def test_kubectl_applies_every_manifest(kmock: K.KubernetesEmulator,
                                              tmp_path: Path) -> None:
    kubectl = Kubectl(kmock, tmp_path)
    for path in MANIFESTS:
        dry = await kubectl("apply", "--dry-run=client", "--validate=false", "-o", "name",
                            "-f", str(path))
        assert len(dry.split()) == len(docs(path)), dry
    assert not [k for k in kmock.objects if k[0].plural != "events"]  # dry: nothing
    for path in MANIFESTS:
        await kubectl("apply", "--validate=false", "-f", str(path))
    stored = {(k[0].plural, k[2]) for k in kmock.objects}
    assert {("customresourcedefinitions", "cachepilotpools.cachepilot.io"),
            ("cachepilotpools", "sim"), ("cachepilotpools", "llama"),
            ("deployments", "cachepilot-sim-worker"), ("deployments", "vllm-llama"),
            ("gateways", "inference-gateway"), ("httproutes", "llm"),
            ("inferencepools", "vllm-llama")} <= stored
    sim = kmock.objects[f"{crd.GROUP}/{crd.VERSION}/{crd.PLURAL}", NS, "sim"].raw
    assert sim["spec"] == find(crd.KIND, "sim")["spec"]


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed")
@pytest.mark.timeout(60)
async def test_kubectl_apply_of_an_inference_pool_makes_the_operator_build_the_pool(
        kmock: K.KubernetesEmulator, tmp_path: Path) -> None:
    kubectl = Kubectl(kmock, tmp_path)
    # Two running vLLM pods: what the example's Deployment would make (KMock runs nothing,
    # and its discovery serves kubectl no core kinds, so they are POSTed as a kubelet would).
    deployment = find("Deployment", "vllm-llama")
    async with aiohttp.ClientSession() as http:
        for i in (1, 2):
            pod = pod_of(deployment)
            pod["metadata"] = {**pod["metadata"], "name": f"vllm-llama-{i}", "namespace": NS}
            pod["status"]["podIP"] = f"10.0.0.{i}"
            async with http.post(f"{kubectl.url}/api/v1/namespaces/{NS}/pods",
                                 json={"apiVersion": "v1", "kind": "Pod", **pod}) as r:
                assert r.status < 300, await r.text()
    router, stop, ready = Router(), asyncio.Event(), asyncio.Event()
    options = OperatorOptions(epp_service="cp-cachepilot-epp", elect_leader=False,
                              resync_period_s=0.5, status_tick_s=0.05)
    task = asyncio.create_task(run_operator(
        router, namespace=NS, stop_flag=stop, ready_flag=ready, identity="gw-0",
        login=lambda: kopf.ConnectionInfo(server=kubectl.url), options=options))
    try:
        async with asyncio.timeout(10):
            await ready.wait()
        assert not router.pools
        example = str(ROOT / "manifests" / "gateway-api-istio.yaml")
        await kubectl("apply", "--validate=false", "-f", example)
        name = ip.router_pool_name("vllm-llama")
        await eventually(lambda: {a: w.ready for a, w in router.pools[name].workers.items()}
                         == {"10.0.0.1:8000": True, "10.0.0.2:8000": True},
                         what="the InferencePool's pool with both pods")
        await kubectl("delete", "-f", example)
        await eventually(lambda: name not in router.pools, what="the pool gone with it")
    finally:
        stop.set()
        async with asyncio.timeout(10):
            await task
