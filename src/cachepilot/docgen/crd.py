"""The CachePilotPool reference: every field of the CRD's schema (cachepilot.operator.crd,
itself built from the routing core's defaults) with its type, default and constraints;
cost-model fields described by the comments on the core's CostModel."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cachepilot.core import BlockConfig, CostModel
from cachepilot.docgen.markdown import code, field_comments, generated_note, prose, table, value
from cachepilot.operator import crd

PATH = "reference/crd.md"

# Fields whose schema has no description, from what the router does with them.
_WEIGHTS = {
    "prefill": "Multiplier on the prefill term of the `priced` policy (1: trust the ms).",
    "load": "Multiplier on the queue term (requests and prefill ahead of this one).",
    "kv": "Multiplier on the KV-pressure term.",
}


# Cost-model fields with no comment on CostModel: the priors of the TTFT model.
_COST = {
    "prefill_ms_per_token": "Prior: ms of prefill per uncached prompt token (the predictor "
                            "learns each worker's own from measured first tokens).",
    "base_ttft_ms": "Prior: the fixed part of a TTFT (HTTP, tokenisation, scheduling).",
}


def _described() -> dict[str, str]:
    """Descriptions from the core's own comments, by CRD path."""
    out: dict[str, str] = {}
    cost = field_comments(CostModel)
    for field, name in crd.COST_FIELDS.items():
        out[f"spec.routing.cost.{name}"] = cost.get(field) or _COST.get(field, "")
    for k, v in _WEIGHTS.items():
        out[f"spec.routing.weights.{k}"] = v
    block = field_comments(BlockConfig)
    out["spec.routing.blockSize"] = block.get(
        "block_size", "Tokens per block, as the engine's KV cache.") or (
        "Tokens per block, as the engine's KV cache.")
    out["spec.routing.charsPerToken"] = block.get("chars_per_token") or (
        "Without a tokenizer a block is blockSize × charsPerToken UTF-8 bytes (a stand-in "
        "with the same sharing structure).")
    out["spec.scrape.path"] = "The engine's Prometheus metrics path."
    out["spec.scrape.intervalSeconds"] = "How often each worker is scraped."
    out["spec.scrape.timeoutSeconds"] = (
        "A scrape that takes longer fails: the worker is down until one succeeds.")
    out["spec.scrape.engine"] = "Which engine's metric names to read."
    out["spec.kvEvents.topic"] = "The ZMQ topic of the publisher (vLLM's `--kv-events-config`)."
    return out


def _type(s: dict[str, Any]) -> str:
    if s.get("x-kubernetes-int-or-string"):
        return "int or string"
    t = s.get("type", "")
    if t == "array":
        item = s.get("items", {})
        return f"array of {_type(item) if item.get('type') != 'object' else 'objects'}"
    return t


def _constraints(s: dict[str, Any]) -> str:
    out = []
    if "enum" in s:
        out.append("one of " + ", ".join(code(v) for v in s["enum"]))
    if "minimum" in s:
        out.append(f"≥ {s['minimum']}")
    if "maximum" in s:
        out.append(f"≤ {s['maximum']}")
    if "minLength" in s:
        out.append(f"length ≥ {s['minLength']}")
    if "minProperties" in s:
        out.append(f"at least {s['minProperties']} key")
    if "pattern" in s:
        out.append("matches " + code(s["pattern"]))
    if "format" in s:
        out.append(s["format"])
    return ", ".join(out)


def fields(schema: dict[str, Any], prefix: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(path, schema) of every property, depth first; array items as ``path[]``."""
    for name, sub in schema.get("properties", {}).items():
        path = f"{prefix}.{name}"
        yield path, sub
        if sub.get("type") == "object":
            yield from fields(sub, path)
        elif sub.get("type") == "array" and sub.get("items", {}).get("type") == "object":
            yield from fields(sub["items"], path + "[]")


def spec_paths() -> list[str]:
    return [p for p, _ in fields(crd.spec_schema(), "spec")]


def status_paths() -> list[str]:
    return [p for p, _ in fields(crd.status_schema(), "status")]


def _rows(schema: dict[str, Any], prefix: str, described: dict[str, str]) -> list[list[str]]:
    rows = []
    for path, s in fields(schema, prefix):
        desc = s.get("description") or described.get(path, "")
        rows.append([code(path), _type(s),
                     value(s["default"]) if "default" in s and s["default"] != {} else "",
                     _constraints(s), prose(desc)])
    return rows


def page(_root: Path) -> str:
    m = crd.crd_manifest()
    names = m["spec"]["names"]
    version = m["spec"]["versions"][0]
    described = _described()
    spec = crd.spec_schema()
    out = [
        "# CachePilotPool\n", generated_note("src/cachepilot/operator/crd.py"),
        f"`apiVersion: {crd.API_VERSION}`, `kind: {crd.KIND}` (namespaced; plural "
        f"`{names['plural']}`, short name{'s' if len(names['shortNames']) > 1 else ''} "
        + ", ".join(f"`{n}`" for n in names["shortNames"])
        + f", category `{names['categories'][0]}`). The CRD file the chart installs "
        "(`charts/cachepilot/files/crd.yaml`, also `manifests/crd.yaml`) is generated from "
        "the same schema (`python -m cachepilot.deploy.generate --write`). Defaults are the "
        "routing core's own, so the API server fills in exactly what the router would "
        "assume.\n",
        "A minimal pool (`manifests/sample-pool.yaml` is a complete one):\n",
        "```yaml\n"
        f"apiVersion: {crd.API_VERSION}\nkind: {crd.KIND}\nmetadata:\n  name: llama\n"
        "spec:\n  models: [llama-3-8b]\n  selector:\n    matchLabels: {app: vllm-llama}\n"
        "  port: 8000\n```\n",
        "## spec\n",
        prose(spec.get("description", "")) + "\n",
        table(["field", "type", "default", "constraints", "meaning"],
              _rows(spec, "spec", described)),
        "## status\n",
        "Written by one gateway replica (the Lease holder); every replica routes on its own "
        "view.\n",
        table(["field", "type", "default", "constraints", "meaning"],
              _rows(crd.status_schema(), "status", described)),
        "## Columns of `kubectl get cachepilotpools`\n",
        table(["column", "from", "shown"],
              [[c["name"], code(c["jsonPath"]), "with `-o wide`" if c.get("priority") else
                "always"] for c in version["additionalPrinterColumns"]]),
    ]
    return "\n".join(out)
