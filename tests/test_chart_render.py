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

from cachepilot.operator import crd, generate

ROOT = Path(__file__).resolve().parents[1]
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
    for values in (None, NON_DEFAULT):
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
