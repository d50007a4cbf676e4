"""manifests/: every object valid for Kubernetes (built-in kinds against Kubernetes' schemas,
CachePilotPools against the CRD), consistent with each other, and applied with the real
``kubectl apply`` (client dry-run, then for real) against KMock's API emulator."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import kmock as K
import kubernetes_validate
import pytest
import yaml
from test_crd_schema import validate_pool

from cachepilot.cli.worker import sim_worker_cmd
from cachepilot.operator import crd
from cachepilot.operator.spec import parse_pool, pod_view, resolve_port

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = sorted((ROOT / "manifests").glob("*.yaml"))
NS = "serving"


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_docs() -> list[dict[str, Any]]:
    return [d for p in MANIFESTS for d in docs(p)]


def find(kind: str, name: str) -> dict[str, Any]:
    return next(d for d in all_docs() if d["kind"] == kind and d["metadata"]["name"] == name)


def test_the_expected_files_exist() -> None:
    assert {p.name for p in MANIFESTS} == {"crd.yaml", "sample-pool.yaml", "sim-workers.yaml",
                                           "vllm-example.yaml"}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_object_is_valid(path: Path) -> None:
    for doc in docs(path):
        if doc["kind"] == crd.KIND:
            validate_pool(doc)
            parse_pool(doc["metadata"]["name"], doc)
        else:
            kubernetes_validate.validate(doc, "1.30.0", strict=True)


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
    args = find("Deployment", "vllm-llama")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--served-model-name={pool.spec.models[0]}" in args
    assert f"--block-size={pool.spec.block.block_size}" in args
    assert pool.scrape.engine == "vllm"


KUBECTL = shutil.which("kubectl")


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed")
async def test_kubectl_applies_every_manifest(kmock: K.KubernetesEmulator,
                                              tmp_path: Path) -> None:
    kmock.resources.load_bundled()
    kmock.resources[f"{crd.GROUP}/{crd.VERSION}/{crd.PLURAL}"] = K.ResourceInfo(
        kind=crd.KIND, namespaced=True, subresources={"status"},
        shortnames=set(crd.SHORT_NAMES),
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"})
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": str(kmock.url).rstrip("/")}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "u",
                                                   "namespace": NS}}]}))

    async def kubectl(*args: str) -> str:
        proc = await asyncio.create_subprocess_exec(
            KUBECTL, f"--kubeconfig={kubeconfig}", *args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        async with asyncio.timeout(60):
            out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        return out.decode()

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
            ("deployments", "cachepilot-sim-worker"), ("deployments", "vllm-llama")} <= stored
    sim = kmock.objects[f"{crd.GROUP}/{crd.VERSION}/{crd.PLURAL}", NS, "sim"].raw
    assert sim["spec"] == find(crd.KIND, "sim")["spec"]
