"""The Helm values reference: every key of the chart's values.yaml with its default, the
comments above it (the chart's own documentation) and what values.schema.json allows."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from cachepilot.docgen.markdown import code, generated_note, prose, table, value

PATH = "reference/helm-values.md"
CHART = Path("charts/cachepilot")
_KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.-]+):(?P<rest>.*)$")


def _strip_comment(rest: str) -> tuple[str, str]:
    """A line's value and its trailing comment (a # after whitespace, outside quotes)."""
    quote = None
    for i, ch in enumerate(rest):
        if ch in "\"'" and quote in (None, ch):
            quote = None if quote else ch
        elif ch == "#" and quote is None and (i == 0 or rest[i - 1] in " \t"):
            return rest[:i].strip(), rest[i + 1:].strip()
    return rest.strip(), ""


def keys(values_text: str) -> list[tuple[str, str]]:
    """(dotted path, comment) of every block-mapping key in values.yaml, in file order. The
    comment is the contiguous comment lines just above the key plus its trailing comment; a
    comment block separated from the key by a blank line belongs to no key."""
    out: list[tuple[str, str]] = []
    stack: list[tuple[int, str]] = []
    pending: list[str] = []
    for line in values_text.splitlines():
        stripped = line.strip()
        if not stripped:
            pending = []
            continue
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
            continue
        m = _KEY.match(line)
        if m is None:  # a list item or a continuation: not a key
            pending = []
            continue
        indent = len(m["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([*(k for _, k in stack), m["key"]])
        _, trailing = _strip_comment(m["rest"])
        out.append((path, " ".join([*pending, trailing]).strip()))
        pending = []
        stack.append((indent, m["key"]))
    return out


def _resolve(schema: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    """A schema node with its $ref and allOf merged in."""
    s = dict(schema)
    ref = s.pop("$ref", None)
    if ref:
        target: Any = root
        for part in ref.lstrip("#/").split("/"):
            target = target[part]
        s = {**_resolve(target, root), **s}
    for sub in s.pop("allOf", []):
        r = _resolve(sub, root)
        mine, theirs = s.get("properties", {}), r.get("properties", {})
        props = {k: {**mine.get(k, {}), **theirs.get(k, {})} for k in {*mine, *theirs}}
        s = {**s, **r, "properties": props}
    return s


def schema_at(schema: dict[str, Any], path: str) -> dict[str, Any] | None:
    node: dict[str, Any] | None = _resolve(schema, schema)
    for part in path.split("."):
        if node is None:
            return None
        props = node.get("properties", {})
        if part in props:
            node = _resolve(props[part], schema)
        elif isinstance(node.get("additionalProperties"), dict):
            node = _resolve(node["additionalProperties"], schema)
        else:
            return None
    return node


def _allowed(s: dict[str, Any] | None) -> str:
    if not s:
        return ""
    out = []
    t = s.get("type")
    if t:
        out.append(" or ".join(t) if isinstance(t, list) else t)
    if "const" in s:
        out.append("fixed: " + code(s["const"]))
    if "enum" in s:
        out.append("one of " + ", ".join(code(v) for v in s["enum"]))
    if "minimum" in s:
        out.append(f"≥ {s['minimum']}")
    if "maximum" in s:
        out.append(f"≤ {s['maximum']}")
    if "maxLength" in s:
        out.append(f"length ≤ {s['maxLength']}")
    if "pattern" in s:
        out.append("matches " + code(s["pattern"]))
    if s.get("required"):
        out.append("requires " + ", ".join(code(r) for r in s["required"]))
    return ", ".join(out)


def _get(values: Any, path: str) -> Any:
    for part in path.split("."):
        values = values[part]
    return values


def documented(root: Path) -> list[str]:
    """The dotted paths the page lists (every key of values.yaml)."""
    return [p for p, _ in keys((root / CHART / "values.yaml").read_text())]


def page(root: Path) -> str:
    text = (root / CHART / "values.yaml").read_text()
    values = yaml.safe_load(text)
    schema = json.loads((root / CHART / "values.schema.json").read_text())
    chart = yaml.safe_load((root / CHART / "Chart.yaml").read_text())
    rows = []
    for path, comment in keys(text):
        default = _get(values, path)
        s = schema_at(schema, path)
        desc = " ".join(x for x in (comment, (s or {}).get("description", "")) if x)
        shown = "" if isinstance(default, dict) and default and _has_children(text, path) \
            else value(default)
        rows.append([code(path), shown, _allowed(s), prose(desc)])
    extra = sorted(set(schema.get("properties", {})) - set(values))
    out = [
        "# Helm values\n",
        generated_note("charts/cachepilot/values.yaml", "charts/cachepilot/values.schema.json"),
        f"The `{chart['name']}` chart, version {chart['version']} (app {chart['appVersion']}; "
        f"Kubernetes {chart.get('kubeVersion', 'any')}). `values.schema.json` rejects "
        "unknown keys and wrong types at `helm install`/`upgrade` time. Set values with "
        "`--set key=value` or `-f my-values.yaml`.\n",
        table(["key", "default", "allowed", "meaning"], rows),
    ]
    if extra:
        out.append("Also accepted by the schema (no default in values.yaml): "
                   + ", ".join(code(k) for k in extra) + ".\n")
    return "\n".join(out)


def _has_children(text: str, path: str) -> bool:
    return any(p.startswith(path + ".") for p, _ in keys(text))
