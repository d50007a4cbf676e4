"""The Helm chart through the real Helm engine (helm-python-sdk: Helm's Go SDK, no binary):
lint, render with default and non-default values, every object checked against
Kubernetes' own schemas (kubernetes-validate), and the chart's hard rules asserted."""

from __future__ import annotations

import base64
import subprocess
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from cachepilot.deploy import generate
from cachepilot.operator import crd

from helpers.paths import ROOT

CHART = ROOT / "charts" / "cachepilot"
K8S_VERSION = "1.30.0"


@pytest.fixture(scope="module")
def chart() -> helm.Chart:
    return helm.Chart.load(CHART)


def render(chart: helm.Chart, values: dict[str, Any] | None = None,
           namespace: str = "serving") -> dict[str, Any]:
    """Rendered objects keyed by "Kind/name" (NOTES.txt under "NOTES")."""
    out: dict[str, Any] = {}
    for path, text in chart.render(values, name="cp", namespace=namespace,
                                   is_install=True).items():
        if path.endswith("NOTES.txt"):
            out["NOTES"] = text
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                key = f"{doc['kind']}/{doc['metadata']['name']}"
                assert key not in out, f"duplicate {key}"
                out[key] = doc
    return out


def containers(objs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    deployment = next(v for k, v in objs.items()
                      if k.startswith("Deployment/") and not k.endswith("-nats"))
    pod = deployment["spec"]["template"]["spec"]
    return {c["name"]: c for c in pod["containers"]}


NON_DEFAULT = {
    "replicaCount": 3,
    "image": {"repository": "registry.example/cachepilot", "tag": "1.2.3",
              "pullPolicy": "Always"},
    "envoy": {"image": {"repository": "envoyproxy/envoy", "tag": "v1.32.1"},
              "logLevel": "debug"},
    "crds": {"install": False},
    "service": {"type": "LoadBalancer", "port": 8080,
                "annotations": {"example.com/lb": "internal"}},
    "serviceAccount": {"create": False, "name": "existing-sa"},
    "podDisruptionBudget": {"enabled": True, "minAvailable": 2},
    "metrics": {"serviceMonitor": {"enabled": True, "interval": "30s",
                                   "labels": {"release": "prom"}}},
    "gateway": {"extraArgs": ["--policy-override=priced"],
                "adminToken": {"existingSecret": "my-token", "key": "t"},
                "leaseName": "my-lease"},
    "nodeSelector": {"pool": "cpu"},
    "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
    "fullnameOverride": "edge",
    "replicaSync": {"natsUrl": "nats://nats.messaging:4222"},
}


def test_lint_is_clean(chart: helm.Chart) -> None:
    for values in (None, NON_DEFAULT, {**EPP, "grafana": {"dashboard": {"enabled": True}}}):
        report = helm.lint(CHART, values, strict=True, namespace="serving",
                           kube_version=f"v{K8S_VERSION}")
        assert report["errors"] == []
        assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("values", [None, NON_DEFAULT], ids=["defaults", "non-default"])
def test_every_object_matches_the_kubernetes_schema(chart: helm.Chart,
                                                   values: dict[str, Any] | None) -> None:
    objs = render(chart, values)
    checked = 0
    for key, doc in objs.items():
        if key == "NOTES" or doc["kind"] == "ServiceMonitor":
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        checked += 1
    assert checked >= 8
    for key, doc in objs.items():
        if key != "NOTES" and doc["kind"] != "CustomResourceDefinition":
            assert doc["metadata"]["namespace"] == "serving", key


def test_the_schema_check_does_catch_mistakes(chart: helm.Chart) -> None:
    deployment = render(chart)["Deployment/cp-cachepilot"]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_default_render(chart: helm.Chart) -> None:
    objs = render(chart)
    kinds = sorted(k.split("/")[0] for k in objs if k != "NOTES")
    assert kinds == ["ConfigMap", "CustomResourceDefinition", "Deployment", "Deployment",
                     "Lease", "PodDisruptionBudget", "Role", "RoleBinding", "Secret", "Service",
                     "Service", "Service", "ServiceAccount"]
    deployment = objs["Deployment/cp-cachepilot"]
    assert deployment["spec"]["replicas"] == 2
    c = containers(objs)
    assert c["gateway"]["image"] == c["envoy"]["image"] == "cachepilot:0.1.0"
    args = c["gateway"]["args"]
    assert args[:2] == ["gateway", "--kubernetes"]
    assert "--namespace=$(POD_NAMESPACE)" in args and "--lease-name=cp-cachepilot-leader" in args
    assert "--listen=127.0.0.1:9002" in args
    # Replicas share their routing state over the chart's own NATS (the gateway image's).
    assert "--replica-bus=nats://cp-cachepilot-nats:4222" in args
    assert "--replica-id=$(POD_NAME)" in args
    assert "--replica-subject=cachepilot.serving.cp-cachepilot" in args  # its own subject
    nats = objs["Deployment/cp-cachepilot-nats"]["spec"]["template"]["spec"]["containers"][0]
    assert nats["command"] == ["nats-server"] and nats["image"] == "cachepilot:0.1.0"
    assert objs["Service/cp-cachepilot-nats"]["spec"]["ports"][0]["port"] == 4222
    env = {e["name"]: e for e in c["gateway"]["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["CACHEPILOT_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "cp-cachepilot-admin", "key": "token"}
    token = objs["Secret/cp-cachepilot-admin"]["data"]["token"]
    assert len(base64.b64decode(token)) == 40
    # Probes and resources on both containers.
    assert c["gateway"]["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    assert c["gateway"]["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["envoy"]["readinessProbe"]["tcpSocket"] == {"port": "http"}
    for container in c.values():
        assert container["resources"]["requests"] and container["resources"]["limits"]
    # Services: inference through Envoy, admin/metrics apart.
    svc = objs["Service/cp-cachepilot"]
    assert svc["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http",
                                     "protocol": "TCP"}]
    assert svc["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert objs["Service/cp-cachepilot-admin"]["spec"]["ports"][0]["targetPort"] == "admin"
    assert objs["PodDisruptionBudget/cp-cachepilot"]["spec"]["minAvailable"] == 1
    assert "ServiceMonitor/cp-cachepilot" not in objs
    assert "kubectl port-forward -n serving svc/cp-cachepilot 8080:80" in objs["NOTES"]
    assert '"model": "sim-llama-8b"' in objs["NOTES"]


def test_pods_are_locked_down(chart: helm.Chart) -> None:
    for values in (None, NON_DEFAULT):
        objs = render(chart, values)
        pod = objs[next(k for k in objs if k.startswith("Deployment/"))]["spec"]["template"]
        spec = pod["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, c["name"]
            assert sc["allowPrivilegeEscalation"] is False, c["name"]
            assert sc["capabilities"] == {"drop": ["ALL"]}, c["name"]
            assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]


def test_rbac_is_exactly_what_the_operator_uses(chart: helm.Chart) -> None:
    objs = render(chart)
    rules = objs["Role/cp-cachepilot"]["rules"]
    granted = {(g, r, v, tuple(rule.get("resourceNames", ())))
               for rule in rules for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    assert granted == {
        ("cachepilot.io", "cachepilotpools", "list", ()),
        ("cachepilot.io", "cachepilotpools", "watch", ()),
        ("cachepilot.io", "cachepilotpools/status", "patch", ()),
        ("", "pods", "list", ()), ("", "pods", "watch", ()),
        ("", "events", "create", ()),
        ("coordination.k8s.io", "leases", "get", ("cp-cachepilot-leader",)),
        ("coordination.k8s.io", "leases", "patch", ("cp-cachepilot-leader",)),
    }
    assert not any(k.startswith(("ClusterRole/", "ClusterRoleBinding/")) for k in objs)
    binding = objs["RoleBinding/cp-cachepilot"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "cp-cachepilot",
                                    "namespace": "serving"}]
    pod = objs["Deployment/cp-cachepilot"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "cp-cachepilot"


def test_envoy_config_is_the_generators_output(chart: helm.Chart) -> None:
    objs = render(chart)
    config = objs["ConfigMap/cp-cachepilot-envoy"]["data"]["envoy.yaml"]
    assert config == generate.envoy_yaml()
    parsed = yaml.safe_load(config)
    listener = parsed["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert listener["port_value"] == generate.ENVOY_LISTEN_PORT
    values = chart.values
    assert values["envoy"]["port"] == generate.ENVOY_LISTEN_PORT
    assert values["envoy"]["adminPort"] == generate.ENVOY_ADMIN_PORT
    assert values["envoy"]["extProcPort"] == generate.EXT_PROC_PORT
    c = containers(objs)
    assert c["envoy"]["ports"][0]["containerPort"] == generate.ENVOY_LISTEN_PORT
    assert c["envoy"]["args"][0] == "--config-path=/etc/envoy/envoy.yaml"
    # The pods roll when the config changes.
    assert objs["Deployment/cp-cachepilot"]["spec"]["template"]["metadata"]["annotations"][
        "checksum/envoy"]


def test_chart_crd_is_the_manifests_crd_plus_labels(chart: helm.Chart) -> None:
    rendered = render(chart)["CustomResourceDefinition/cachepilotpools.cachepilot.io"]
    labels = rendered["metadata"].pop("labels")
    assert labels["app.kubernetes.io/managed-by"] == "Helm"
    assert rendered == yaml.safe_load((ROOT / "manifests" / "crd.yaml").read_text())
    assert rendered == crd.crd_manifest()
    kept = render(chart, {"crds": {"keep": True}})[
        "CustomResourceDefinition/cachepilotpools.cachepilot.io"]
    assert kept["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}


def test_non_default_values_take_effect(chart: helm.Chart) -> None:
    objs = render(chart, NON_DEFAULT)
    assert "CustomResourceDefinition/cachepilotpools.cachepilot.io" not in objs
    assert "ServiceAccount/edge" not in objs and "Secret/edge-admin" not in objs
    deployment = objs["Deployment/edge"]
    pod = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] == 3
    assert pod["serviceAccountName"] == "existing-sa"
    assert pod["nodeSelector"] == {"pool": "cpu"}
    assert pod["tolerations"][0]["key"] == "dedicated"
    c = containers(objs)
    # An existing NATS: the chart runs none of its own.
    assert "--replica-bus=nats://nats.messaging:4222" in c["gateway"]["args"]
    assert "Deployment/edge-nats" not in objs and "Service/edge-nats" not in objs
    assert c["gateway"]["image"] == "registry.example/cachepilot:1.2.3"
    assert c["gateway"]["imagePullPolicy"] == "Always"
    assert c["envoy"]["image"] == "envoyproxy/envoy:v1.32.1"
    assert "--log-level=debug" in c["envoy"]["args"]
    assert c["gateway"]["args"][-1] == "--policy-override=priced"
    assert "--lease-name=my-lease" in c["gateway"]["args"]
    env = {e["name"]: e for e in c["gateway"]["env"]}
    assert env["CACHEPILOT_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "my-token",
                                                                          "key": "t"}
    assert objs["Service/edge"]["spec"]["type"] == "LoadBalancer"
    assert objs["Service/edge"]["metadata"]["annotations"] == {"example.com/lb": "internal"}
    assert objs["PodDisruptionBudget/edge"]["spec"]["minAvailable"] == 2
    monitor = objs["ServiceMonitor/edge"]
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["endpoints"] == [{"port": "admin", "path": "/metrics",
                                             "interval": "30s"}]
    assert monitor["spec"]["selector"]["matchLabels"]["cachepilot.io/service"] == "admin"
    assert objs["Service/edge-admin"]["metadata"]["labels"]["cachepilot.io/service"] == "admin"
    rules = objs["Role/edge"]["rules"]
    assert any(r.get("resourceNames") == ["my-lease"] for r in rules)
    assert "manifests/crd.yaml" in objs["NOTES"]


def test_standard_labels_on_every_object(chart: helm.Chart) -> None:
    for key, doc in render(chart).items():
        if key == "NOTES":
            continue
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "cachepilot", key
        assert labels["app.kubernetes.io/instance"] == "cp", key
        assert labels["app.kubernetes.io/managed-by"] == "Helm", key
        assert labels["helm.sh/chart"] == "cachepilot-0.1.0", key
        assert labels["app.kubernetes.io/version"] == "0.1.0", key


@pytest.mark.parametrize("bad", [
    {"replicaCount": 0},
    {"image": {"repository": ""}},
    {"service": {"type": "Ingress"}},
    {"envoy": {"port": 9999}},
    {"gateway": {"readinessPath": "/"}},
    {"metrics": {"serviceMonitor": {"interval": "soon"}}},
    {"typo": True},
    {"replicaSync": {"natsUrl": "redis://cache:6379"}},
])
def test_values_schema_rejects_bad_values(chart: helm.Chart, bad: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmError):
        chart.validate_schema(bad)
    with pytest.raises(helm.HelmError):
        chart.render(bad, name="cp", namespace="serving")


def test_values_schema_accepts_the_documented_values(chart: helm.Chart) -> None:
    chart.validate_schema(None)
    chart.validate_schema(NON_DEFAULT)
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    assert chart.values == defaults


def test_envoy_accepts_the_charts_config(tmp_path: Path) -> None:
    from cachepilot.tooling.stack import envoy_binary

    config = tmp_path / "envoy.yaml"
    config.write_text((CHART / "files" / "envoy.yaml").read_text())
    proc = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(config)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout + proc.stderr


def test_replica_sync_can_be_turned_off(chart: helm.Chart) -> None:
    objs = render(chart, {"replicaSync": {"enabled": False}})
    assert not any(k.endswith("-nats") for k in objs)
    assert not any(a.startswith("--replica-") for a in containers(objs)["gateway"]["args"])


# ---- CachePilot as an endpoint picker (EPP) of InferencePools ----------------------------

EPP = {"epp": {"enabled": True, "installInferencePoolCRD": True,
               "inferencePool": {"create": True, "name": "vllm-llama",
                                 "matchLabels": {"app.kubernetes.io/name": "vllm-llama"},
                                 "targetPorts": [8000, 8001]}}}


def test_epp_render_is_valid_for_kubernetes_and_the_inference_pool_crd(
        chart: helm.Chart) -> None:
    from helpers.schemas import validate_inference_pool

    objs = render(chart, EPP)
    pools = [doc for key, doc in objs.items() if key.startswith("InferencePool/")]
    assert len(pools) == 1
    for doc in pools:
        validate_inference_pool(doc)
    checked = 0
    for key, doc in objs.items():
        if key == "NOTES" or doc["kind"] == "InferencePool":
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        checked += 1
    assert checked >= 12


def test_epp_service_names_what_an_inference_pool_needs(chart: helm.Chart) -> None:
    from cachepilot.cli.gateway import gateway_cmd
    from cachepilot.operator import inferencepool as ip

    objs = render(chart, EPP)
    svc = objs["Service/cp-cachepilot-epp"]
    assert svc["spec"]["selector"] == objs["Deployment/cp-cachepilot"]["spec"]["selector"][
        "matchLabels"]
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert ports["grpc-ext-proc"]["port"] == 9002 and ports["grpc-health"]["port"] == 9003
    assert {p["targetPort"] for p in ports.values()} == {"ext-proc"}
    assert {p["appProtocol"] for p in ports.values()} == {"kubernetes.io/h2c"}
    gateway = containers(objs)["gateway"]
    assert {"name": "ext-proc", "containerPort": generate.EXT_PROC_PORT,
            "protocol": "TCP"} in gateway["ports"]
    args = gateway["args"]
    # Gateways reach ext_proc over the pod network; the operator watches InferencePools
    # that name this Service. The flags are the real command's (parsed by click).
    assert f"--listen=0.0.0.0:{generate.EXT_PROC_PORT}" in args
    assert "--epp-service=cp-cachepilot-epp" in args
    ctx = gateway_cmd.make_context("gateway", [a.replace("$(POD_NAMESPACE)", "serving")
                                               .replace("$(POD_NAME)", "gw-0")
                                               for a in args[1:]])
    assert ctx.params["epp_service"] == "cp-cachepilot-epp" and ctx.params["kubernetes"]
    # The chart's InferencePool points at that Service and port.
    view = ip.parse(objs["InferencePool/vllm-llama"])
    assert view.picked_by(svc["metadata"]["name"]) and view.picker.port == 9002
    assert view.source.ports == (8000, 8001)
    assert view.picker.failure_mode == "FailClose"
    # Envoy still runs beside it: both modes route with the same gateway.
    assert "envoy" in containers(objs)
    assert "name: cp-cachepilot-epp, port: {number: 9002}" in objs["NOTES"]


def test_epp_off_by_default_keeps_ext_proc_on_loopback(chart: helm.Chart) -> None:
    objs = render(chart)
    assert not any(k.endswith("-epp") or k.startswith("InferencePool/") for k in objs)
    args = containers(objs)["gateway"]["args"]
    assert not any(a.startswith("--epp-service") for a in args)
    assert f"--listen=127.0.0.1:{generate.EXT_PROC_PORT}" in args
    # epp.enabled alone: the Service and RBAC, no InferencePool and no CRD of ours.
    objs = render(chart, {"epp": {"enabled": True, "serviceName": "llm-picker"}})
    assert "Service/llm-picker" in objs
    assert "--epp-service=llm-picker" in containers(objs)["gateway"]["args"]
    assert not any(k.startswith("InferencePool/") for k in objs)
    assert "CustomResourceDefinition/inferencepools.inference.networking.k8s.io" not in objs


def test_epp_rbac_adds_exactly_inference_pools(chart: helm.Chart) -> None:
    def granted(values: dict[str, Any] | None) -> set[tuple[str, str, str]]:
        rules = render(chart, values)["Role/cp-cachepilot"]["rules"]
        return {(g, r, v) for rule in rules for g in rule["apiGroups"]
                for r in rule["resources"] for v in rule["verbs"]}

    assert granted(EPP) - granted(None) == {
        ("inference.networking.k8s.io", "inferencepools", "list"),
        ("inference.networking.k8s.io", "inferencepools", "watch")}
    assert granted(None) <= granted(EPP)


def test_vendored_inference_pool_crd_renders_unchanged_plus_labels(chart: helm.Chart) -> None:
    objs = render(chart, EPP)
    rendered = objs["CustomResourceDefinition/inferencepools.inference.networking.k8s.io"]
    assert rendered["metadata"].pop("labels")["app.kubernetes.io/managed-by"] == "Helm"
    assert rendered == yaml.safe_load((CHART / "files" / "inferencepool-crd.yaml").read_text())
    kept = render(chart, {**EPP, "crds": {"keep": True}})[
        "CustomResourceDefinition/inferencepools.inference.networking.k8s.io"]
    assert kept["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


# ---- Grafana dashboard ---------------------------------------------------------------------

def test_grafana_dashboard_configmap(chart: helm.Chart) -> None:
    import json

    assert not any(k.endswith("-dashboard") for k in render(chart))
    objs = render(chart, {"grafana": {"dashboard": {"enabled": True}}})
    cm = objs["ConfigMap/cp-cachepilot-dashboard"]
    kubernetes_validate.validate(cm, K8S_VERSION, strict=True)
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "serving"
    (text,) = cm["data"].values()
    source = (CHART / "files" / "grafana-dashboard.json").read_text()
    assert json.loads(text) == json.loads(source) and json.loads(text)["panels"]
    custom = render(chart, {"grafana": {"dashboard": {
        "enabled": True, "labels": {"dashboards": "llm", "grafana_dashboard": None},
        "namespace": "monitoring",
        "annotations": {"grafana_folder": "LLM"}}}})["ConfigMap/cp-cachepilot-dashboard"]
    assert custom["metadata"]["namespace"] == "monitoring"
    assert custom["metadata"]["labels"]["dashboards"] == "llm"
    assert "grafana_dashboard" not in custom["metadata"]["labels"]
    assert custom["metadata"]["annotations"] == {"grafana_folder": "LLM"}


@pytest.mark.parametrize("bad", [
    {"epp": {"enabled": "yes"}},
    {"epp": {"serviceName": "Picker"}},
    {"epp": {"port": 0}},
    {"epp": {"inferencePool": {"targetPorts": list(range(8000, 8009))}}},
    {"epp": {"inferencePool": {"targetPorts": [8000, 8000]}}},
    {"epp": {"inferencePool": {"failureMode": "Open"}}},
    {"epp": {"typo": True}},
    {"grafana": {"dashboard": {"enabled": True, "labels": {"a": 1}}}},
    {"grafana": {"dashboards": {}}},
])
def test_values_schema_rejects_bad_epp_and_grafana_values(chart: helm.Chart,
                                                          bad: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmError):
        chart.validate_schema(bad)


def test_an_inference_pool_without_labels_is_a_clear_error(chart: helm.Chart) -> None:
    with pytest.raises(helm.HelmError, match="matchLabels is required"):
        chart.render({"epp": {"enabled": True, "inferencePool": {"create": True,
                                                                 "name": "x"}}},
                     name="cp", namespace="serving")


def test_the_gateway_can_mount_the_workers_tokenizer(chart: helm.Chart) -> None:
    """Exact KV-event matching in Kubernetes: the tokenizer from a ConfigMap, and the flags."""
    objs = render(chart, {"gateway": {
        "extraArgs": ["--tokenizer=/etc/cachepilot/tokenizer.json", "--vllm-hash-seed=0"],
        "extraVolumes": [{"name": "tokenizer", "configMap": {"name": "llama-tokenizer"}}],
        "extraVolumeMounts": [{"name": "tokenizer", "mountPath": "/etc/cachepilot",
                               "readOnly": True}]}})
    deployment = objs["Deployment/cp-cachepilot"]
    kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    gateway = containers(objs)["gateway"]
    assert {"name": "tokenizer", "mountPath": "/etc/cachepilot", "readOnly": True} in \
        gateway["volumeMounts"]
    assert {"name": "tmp", "mountPath": "/tmp"} in gateway["volumeMounts"]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tokenizer"]["configMap"]["name"] == "llama-tokenizer"
    assert gateway["args"][-2:] == ["--tokenizer=/etc/cachepilot/tokenizer.json",
                                    "--vllm-hash-seed=0"]
    with pytest.raises(helm.HelmError):
        chart.validate_schema({"gateway": {"extraVolumeMounts": [{"name": "x"}]}})


def envoy_config_of(init: dict, tmp_path: Path) -> str:
    """Run the chart's envoy-config init container's arguments; the config it writes."""
    from click.testing import CliRunner

    from cachepilot.cli.gateway import envoy_config_cmd

    out = tmp_path / "envoy.yaml"
    args = [a if not a.startswith("--output=") else f"--output={out}" for a in init["args"][1:]]
    result = CliRunner().invoke(envoy_config_cmd, args)
    assert result.exit_code == 0, result.output
    return out.read_text()


def test_processes_per_pod_get_envoy_config_for_them(chart: helm.Chart, tmp_path: Path) -> None:
    """gateway.processes: 2 runs `cachepilot gateway --processes=2`, and an init container
    writes Envoy's config for two processes with the generator's own options (the chart's
    ports), which the Envoy container then reads instead of the ConfigMap."""
    from cachepilot.deploy.envoy import render as render_envoy

    objs = render(chart, {"gateway": {"processes": 2}})
    pod = objs["Deployment/cp-cachepilot"]["spec"]["template"]["spec"]
    c = containers(objs)
    assert "--processes=2" in c["gateway"]["args"]
    init = pod["initContainers"][0]
    assert init["command"] == ["cachepilot"] and init["args"][0] == "envoy-config"
    volume = next(v for v in pod["volumes"] if v["name"] == "envoy-config")
    assert "emptyDir" in volume and "configMap" not in volume
    written = envoy_config_of(init, tmp_path)
    assert written == render_envoy(generate.chart_envoy_options(ext_proc_processes=2))
    assert "--processes=2" not in containers(render(chart))["gateway"]["args"]
    assert "initContainers" not in render(chart)["Deployment/cp-cachepilot"]["spec"][
        "template"]["spec"]


def test_one_request_per_worker_connection_gets_envoy_config_for_it(
        chart: helm.Chart, tmp_path: Path) -> None:
    """envoy.workerRequestsPerConnection (1 for llama.cpp workers): the init container writes
    Envoy's config with that limit on the clusters to workers."""
    from cachepilot.deploy.envoy import render as render_envoy

    objs = render(chart, {"envoy": {"workerRequestsPerConnection": 1}})
    pod = objs["Deployment/cp-cachepilot"]["spec"]["template"]["spec"]
    init = pod["initContainers"][0]
    assert "--worker-requests-per-connection=1" in init["args"]
    assert "--processes=2" not in containers(objs)["gateway"]["args"]
    written = envoy_config_of(init, tmp_path)
    assert written == render_envoy(generate.chart_envoy_options(worker_requests_per_connection=1))
    assert "max_requests_per_connection: 1" in written
    with pytest.raises(helm.HelmError):
        chart.validate_schema({"envoy": {"workerRequestsPerConnection": -1}})


def test_flow_control_values_reach_the_gateway_and_the_role(chart: helm.Chart) -> None:
    from cachepilot.core.flow.config import FlowConfig, parse_flow

    args = containers(render(chart))["gateway"]["args"]
    assert "--flow-control=on" in args
    assert not any(a.startswith(("--flow=", "--inference-objectives")) for a in args)
    values = {"flowControl": {"enabled": False, "settings": {"ttl_s": 10, "hold_depth": 2},
                              "inferenceObjectives": {"enabled": True}}}
    objs = render(chart, values)
    args = containers(objs)["gateway"]["args"]
    assert "--flow-control=off" in args
    flow = next(a for a in args if a.startswith("--flow="))
    assert FlowConfig(**parse_flow(flow.removeprefix("--flow="))) == FlowConfig(
        ttl_s=10.0, hold_depth=2)
    assert "--inference-objectives=inference.networking.x-k8s.io" in args
    rules = objs["Role/cp-cachepilot"]["rules"]
    granted = {(g, r, v) for rule in rules for g in rule["apiGroups"]
               for r in rule["resources"] for v in rule["verbs"]}
    default = {(g, r, v) for rule in render(chart)["Role/cp-cachepilot"]["rules"]
               for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    assert granted - default == {
        ("inference.networking.x-k8s.io", "inferenceobjectives", "list"),
        ("inference.networking.x-k8s.io", "inferenceobjectives", "watch")}
