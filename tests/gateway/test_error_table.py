"""The error table (cachepilot.gateway.errors) against the code, both ways: every error the
core and the gateway raise and every reply in the generated Envoy bootstrap has its row, and
every row is still produced somewhere. The docs' reference and troubleshooting pages are
generated from the table."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

import cachepilot
from cachepilot.deploy.envoy import bootstrap
from cachepilot.deploy.envoy.ours import EnvoyOptions
from cachepilot.gateway.errors import ENVOY, ERRORS, GATEWAY
from cachepilot.gateway.protocol import ERROR_HEADER

SRC = Path(cachepilot.__file__).parent
# What answers a client through the gateway: the core's errors and the gateway's own.
# (tooling/sim_worker.py raises RequestError too, but as a worker, not as the gateway.)
GATEWAY_PACKAGES = ("core", "gateway")
ERROR_CLASSES = {"RequestError", "RoutingError"}


def _raised() -> Iterator[tuple[int, str, bool, str]]:
    """(status, type, has Retry-After, where) of every RequestError built in the gateway's
    packages, read from the source (the status and code are literals there)."""
    for package in GATEWAY_PACKAGES:
        for path in sorted((SRC / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id in ERROR_CLASSES):
                    continue
                where = f"{path.relative_to(SRC)}:{node.lineno}"
                assert node.args and isinstance(node.args[0], ast.Constant), (
                    f"{where}: the status must be a literal for the error table's check")
                kw = {k.arg: k.value for k in node.keywords}
                code = kw.get("code")
                if code is not None:
                    assert isinstance(code, ast.Constant), f"{where}: code must be a literal"
                yield (node.args[0].value, "invalid_request" if code is None else code.value,
                       "retry_after_s" in kw, where)


def _envoy_replies(cfg: Any) -> Iterator[tuple[int | None, str, bool]]:
    """(status or None for Envoy's own, type, has Retry-After) of every direct response and
    local-reply mapper in a bootstrap."""
    if isinstance(cfg, dict):
        if "direct_response" in cfg and "body" in cfg["direct_response"]:
            reply = cfg["direct_response"]
            body = orjson.loads(reply["body"]["inline_string"])
            yield reply["status"], body["error"]["type"], False
        if "mappers" in cfg:
            for m in cfg["mappers"]:
                headers = {h["header"]["key"]: h["header"]["value"]
                           for h in m.get("headers_to_add", [])}
                yield m.get("status_code"), headers[ERROR_HEADER], "retry-after" in headers
        for v in cfg.values():
            yield from _envoy_replies(v)
    elif isinstance(cfg, list):
        for v in cfg:
            yield from _envoy_replies(v)


def _bootstraps() -> list[dict[str, Any]]:
    return [bootstrap(EnvoyOptions()),
            bootstrap(EnvoyOptions(workers=("127.0.0.1:8001", "127.0.0.1:8002"))),
            bootstrap(EnvoyOptions(fail_open=True, fallback_workers=("127.0.0.1:8001",)))]


def _rows(source: str) -> dict[tuple[int | None, str], bool]:
    return {(e.status, e.type): e.retry_after for e in ERRORS if e.source == source}


def test_every_gateway_error_has_its_row() -> None:
    rows = _rows(GATEWAY)
    raised = list(_raised())
    assert len(raised) > 10
    for status, code, retry_after, where in raised:
        assert (status, code) in rows, (
            f"{where} answers {status} {code!r}: add it to cachepilot.gateway.errors.ERRORS")
        assert rows[status, code] == retry_after, f"{where}: Retry-After differs from the table"
    stale = set(rows) - {(s, c) for s, c, _, _ in raised} - set(_flow_refusals())
    assert not stale, f"rows no code raises any more: {stale}"
    for status, code in _flow_refusals():
        assert rows.get((status, code)) is True, f"flow control's {code}: add its row"


def _flow_refusals() -> list[tuple[int, str]]:
    """Flow control refuses with a reason, not a literal code (FlowError's type is
    flow_<reason>; cachepilot.core.flow.refusal): 503 with no ready worker, else 429."""
    from cachepilot.core.flow.info import NO_READY_WORKER, SHED_REASONS

    return [(503 if r == NO_READY_WORKER else 429, f"flow_{r}") for r in SHED_REASONS]


def test_every_envoy_reply_has_its_row() -> None:
    rows = _rows(ENVOY)
    replies = {r for cfg in _bootstraps() for r in _envoy_replies(cfg)}
    assert replies
    for status, kind, retry_after in replies:
        assert (status, kind) in rows, (
            f"Envoy's bootstrap answers {status} {kind!r}: add it to the error table")
        assert rows[status, kind] == retry_after, f"{status} {kind}: Retry-After differs"
    stale = set(rows) - {(s, k) for s, k, _ in replies}
    assert not stale, f"rows the bootstrap no longer answers: {stale}"


def test_rows_are_unique_and_described() -> None:
    keys = [(e.status, e.type, e.source) for e in ERRORS]
    assert len(keys) == len(set(keys))
    for e in ERRORS:
        assert e.source in (GATEWAY, ENVOY)
        assert e.when.strip() and e.action.strip()

