"""Which content format vLLM hands a chat template: ``openai`` (each message's content a list
of ``{"type": "text", "text": …}`` parts, joined by the template) or ``string`` (the parts
joined with ``"\\n"`` before the template sees them). The two render differently, so the
gateway must pick what vLLM picks.

A port of vLLM 0.32's AST walk (``vllm/renderers/hf.py``: ``_detect_content_format`` and the
``_iter_nodes_*`` helpers it uses): ``openai`` when the template has a ``for`` loop over a
message's ``content`` (directly, through a variable assigned from it, or through a macro
parameter it is passed as), else ``string``. Kept line for line so a template vLLM classifies
one way is classified the same way here; ``--chat-template-content-format`` overrides both.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Literal

import jinja2
import jinja2.nodes as n

ContentFormat = Literal["string", "openai"]


class _Unsure(Exception):
    """Where vLLM's walk asserts (a loop or assignment target that is not a plain name), it
    falls back to ``string``: so does this one."""


def _name(node: n.Node) -> str:
    if not isinstance(node, n.Name):
        raise _Unsure
    return node.name


def _is_var_access(node: n.Node, varname: str) -> bool:
    return isinstance(node, n.Name) and node.ctx == "load" and node.name == varname


def _is_attr_access(node: n.Node, varname: str, key: str) -> bool:
    if isinstance(node, n.Getitem):
        return (_is_var_access(node.node, varname) and isinstance(node.arg, n.Const)
                and node.arg.value == key)
    if isinstance(node, n.Getattr):
        return _is_var_access(node.node, varname) and node.attr == key
    return False


def _is_var_or_elems_access(node: n.Node, varname: str, key: str | None = None) -> bool:
    if isinstance(node, n.Filter):
        return node.node is not None and _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, n.Test):
        return _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, n.Getitem) and isinstance(node.arg, n.Slice):
        return _is_var_or_elems_access(node.node, varname, key)
    return _is_attr_access(node, varname, key) if key else _is_var_access(node, varname)


def _assigned_from(root: n.Node, varname: str) -> Iterator[str]:
    """``varname`` and every variable assigned (transitively) from it or its elements."""
    yield varname
    related = deque([varname])
    while related:
        name = related.popleft()
        for assign in root.find_all(n.Assign):
            if _is_var_or_elems_access(assign.node, name):
                target = _name(assign.target)
                yield target
                if target != name:  # a self-assignment would loop forever
                    related.append(target)


def _message_loop_vars(root: n.Node) -> Iterator[str]:
    """Loop variables of ``{% for message in messages %}`` (or a variable derived from it)."""
    names = list(_assigned_from(root, "messages"))
    for loop in root.find_all(n.For):
        for varname in names:
            if _is_var_or_elems_access(loop.iter, varname):
                yield _name(loop.target)
                break


def _content_loops(root: n.Node) -> Iterator[str]:
    """Loops over a message's content, or over a macro parameter bound to it."""
    message_vars = list(_message_loop_vars(root))
    params_by_loop: dict[int, set[str]] = {}
    loops_in_macros: set[int] = set()
    for macro in root.find_all(n.Macro):
        param_names = {arg.name for arg in macro.args}
        content_params: set[str] = set()
        for call in root.find_all(n.Call):
            if not (isinstance(call.node, n.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and any(
                        _is_var_or_elems_access(arg, v, "content") for v in message_vars):
                    content_params.add(macro.args[i].name)
            for kw in call.kwargs:
                if kw.key in param_names and any(
                        _is_var_or_elems_access(kw.value, v, "content") for v in message_vars):
                    content_params.add(kw.key)
        for loop in macro.find_all(n.For):
            loops_in_macros.add(id(loop))
            if content_params:
                params_by_loop[id(loop)] = content_params
    for loop in root.find_all(n.For):
        if any(_is_var_or_elems_access(loop.iter, v, "content") for v in message_vars):
            yield _name(loop.target)
            continue
        params = params_by_loop.get(id(loop))
        if isinstance(loop.iter, n.Name) and params is not None and loop.iter.name in params:
            yield _name(loop.target)
            continue
        if (id(loop) not in loops_in_macros and isinstance(loop.iter, n.Name)
                and loop.iter.name == "content"):
            yield _name(loop.target)


def detect_content_format(ast: jinja2.nodes.Template) -> ContentFormat:
    """``openai`` if the template iterates over message content, else ``string``."""
    try:
        return "openai" if next(_content_loops(ast), None) is not None else "string"
    except _Unsure:
        return "string"
