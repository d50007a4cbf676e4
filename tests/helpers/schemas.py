"""The CRDs' schemas as validators: the CachePilotPool CRD we generate and upstream's
InferencePool CRD as vendored in the chart, each turned into a JSON Schema, and an
InferencePool's body as a test writes one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jsonschema
import pytest
import yaml

from cachepilot.operator import crd
from cachepilot.operator import inferencepool as ip
from cachepilot.operator.spec import InvalidSpec

from helpers.paths import ROOT

VENDORED = ROOT / "charts" / "cachepilot" / "files" / "inferencepool-crd.yaml"


def to_jsonschema(node: Any) -> Any:
    """openAPIV3Schema → JSON Schema: int-or-string becomes an explicit anyOf."""
    if isinstance(node, dict):
        out = {k: to_jsonschema(v) for k, v in node.items()
               if k not in ("x-kubernetes-list-type", "x-kubernetes-list-map-keys")}
        if out.pop("x-kubernetes-int-or-string", False):
            out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        return out
    if isinstance(node, list):
        return [to_jsonschema(v) for v in node]
    return node


def pool_schema() -> dict[str, Any]:
    version = crd.crd_manifest()["spec"]["versions"][0]
    return to_jsonschema(version["schema"]["openAPIV3Schema"])


def validate_pool(body: dict[str, Any]) -> None:
    jsonschema.Draft7Validator(pool_schema()).validate(body)


def vendored_crd() -> dict[str, Any]:
    return yaml.safe_load(VENDORED.read_text())


def inference_pool_schema() -> dict[str, Any]:
    (version,) = [v for v in vendored_crd()["spec"]["versions"] if v["name"] == ip.VERSION]
    return to_jsonschema(version["schema"]["openAPIV3Schema"])


def validate_inference_pool(body: dict[str, Any]) -> None:
    """Upstream's OpenAPI schema (its two CEL rules are what :func:`ip.parse` checks too)."""
    assert body["apiVersion"] == ip.API_VERSION and body["kind"] == ip.KIND
    jsonschema.Draft7Validator(inference_pool_schema()).validate(body)


def infpool(name: str = "llama", *, picker: str | None = "cp-cachepilot-epp",
            ports: tuple[int, ...] = (8000,), **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "selector": {"matchLabels": {"app": "vllm"}},
        "targetPorts": [{"number": p} for p in ports]}
    if picker is not None:
        body["endpointPickerRef"] = {"name": picker, "port": {"number": 9002}}
    body.update(spec)
    return {"apiVersion": ip.API_VERSION, "kind": ip.KIND,
            "metadata": {"name": name, "namespace": "serving", "uid": f"uid-{name}"},
            "spec": body}


def rejected(body: dict[str, Any], validate: Callable[[dict[str, Any]], None],
             parse: Callable[[dict[str, Any]], object], *, schema_rejects: bool) -> str:
    """A body the API server's schema refuses (``schema_rejects``) or lets through to our
    parser, which refuses it either way: the parser's reason."""
    if schema_rejects:
        with pytest.raises(jsonschema.ValidationError):
            validate(body)
    else:
        validate(body)
    with pytest.raises(InvalidSpec) as e:
        parse(body)
    return e.value.reason

