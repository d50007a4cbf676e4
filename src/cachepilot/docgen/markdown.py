"""Small Markdown helpers shared by the generated reference pages."""

from __future__ import annotations

import ast
import inspect
import json
import textwrap
from collections.abc import Iterable, Sequence
from typing import Any

import yaml


def esc(text: Any) -> str:
    """Plain text as one Markdown table cell (or inline text): no HTML, no emphasis, no pipes,
    no line breaks."""
    s = " ".join(str(text).split())
    s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    for ch in ("\\", "|", "*", "_", "["):
        s = s.replace(ch, "\\" + ch)
    return s


def code(text: Any) -> str:
    """Inline code, also inside a table cell (Python-Markdown's tables do not split a row
    at a pipe inside a code span, so none is escaped)."""
    s = " ".join(str(text).split())
    fence = "``" if "`" in s else "`"
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    return f"{fence}{pad}{s}{pad}{fence}"


def prose(text: str | None) -> str:
    """Help or comment text that may already use `code` spans: kept as Markdown, but one line
    and with table pipes escaped."""
    if not text:
        return ""
    s = " ".join(text.split()).replace("|", "\\|")
    return s if "`" in s else s.replace("<", "&lt;")


def value(v: Any) -> str:
    """A default or example value as inline code ("" shows as an empty string)."""
    if v is None:
        return ""
    if isinstance(v, str):  # quoted when YAML would read it as something else ("", "1")
        return code(json.dumps(v)) if not isinstance(yaml.safe_load(v), str) else code(v)
    if isinstance(v, bool):
        return code(str(v).lower())
    return code(json.dumps(v, separators=(", ", ": ")) if isinstance(v, dict | list) else v)


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def generated_note(*sources: str) -> str:
    """The admonition every generated page opens with."""
    names = ", ".join(f"`{s}`" for s in sources)
    return (f'!!! info "Generated from the code"\n    This page is generated from {names} '
            "when the site is built (`make docs`), so it cannot drift from the code. Do not "
            "edit it: change the code.\n")


def field_comments(cls: type) -> dict[str, str]:
    """A dataclass's field comments from its source: the comment lines just above a field
    and the comment at the end of its line, joined."""
    src = textwrap.dedent(inspect.getsource(cls))
    lines = src.splitlines()
    node = ast.parse(src).body[0]
    assert isinstance(node, ast.ClassDef)
    out: dict[str, str] = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        parts: list[str] = []
        i = stmt.lineno - 2
        above: list[str] = []
        while i >= 0 and lines[i].strip().startswith("#"):
            above.insert(0, lines[i].strip().lstrip("#").strip())
            i -= 1
        parts += above
        end = lines[(stmt.end_lineno or stmt.lineno) - 1]
        if "#" in end:
            parts.append(end.split("#", 1)[1].strip())
        if parts:
            out[stmt.target.id] = " ".join(parts)
    return out


def dict_comments(module: Any, name: str) -> dict[str, str]:
    """The trailing comments of a module-level dict literal's entries, by key."""
    src = inspect.getsource(module)
    lines = src.splitlines()
    for node in ast.parse(src).body:
        target = (node.target if isinstance(node, ast.AnnAssign) else
                  node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == name and isinstance(
                node.value, ast.Dict):
            out: dict[str, str] = {}
            prev_end = node.lineno
            for k, v in zip(node.value.keys, node.value.values, strict=True):
                if not isinstance(k, ast.Constant):
                    continue
                parts = [ln.strip().lstrip("#").strip() for ln in lines[prev_end:k.lineno - 1]
                         if ln.strip().startswith("#")]
                end = lines[(v.end_lineno or v.lineno) - 1]
                if "#" in end:
                    parts.append(end.split("#", 1)[1].strip())
                out[k.value] = " ".join(parts)
                prev_end = v.end_lineno or v.lineno
            return out
    raise KeyError(name)
