"""A pool names its engines' prompt path in ``spec.routing.tokenizer`` (files mounted into the
gateway's pod): the operator validates it, loads it when the pool is applied (I/O at the
edge), and a pool whose files cannot be read never borrows the gateway's tokenizer."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from cachepilot.core import Router
from cachepilot.core.request import parse_openai_body
from cachepilot.operator import crd
from cachepilot.operator.reconcile import Reconciler
from cachepilot.operator.spec import InvalidSpec, TokenizerSource, parse_pool

from helpers.schemas import validate_pool


def model_folder(tmp: Path, template: str | None = "{{ bos_token }}{% for m in messages %}"
                 "{{ m['content'] }}{% endfor %}") -> Path:
    """A word-level tokenizer.json, its tokenizer_config.json and maybe a template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<bos>": 0, "hi": 1, "there": 2, "[UNK]": 3},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<bos>"])
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>"}))
    if template is not None:
        (tmp / "chat_template.jinja").write_text(template)
    return tmp


def cpool(**routing: Any) -> dict[str, Any]:
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
            "metadata": {"name": "p", "generation": 1, "uid": "u1"},
            "spec": {"selector": {"matchLabels": {"app": "vllm"}}, "port": 8000,
                     "routing": {"blockSize": 2, "vllmHashSeed": "0", **routing}}}


def test_the_field_is_in_the_crd_and_parsed() -> None:
    body = cpool(tokenizer={"path": "/models/gemma", "chatTemplate": "/models/t.jinja",
                            "loraModules": ["tiny=/adapters/tiny"],
                            "servedModelNames": ["gemma"]})
    validate_pool(body)
    assert parse_pool("p", body).tokenizer == TokenizerSource(
        "/models/gemma", "/models/t.jinja", "auto", ("tiny=/adapters/tiny",), ("gemma",))
    assert parse_pool("p", cpool()).tokenizer is None


@pytest.mark.parametrize("tok", [{}, {"path": ""}, {"path": "/m", "loraModules": ["tiny"]},
                                 {"path": "/m", "chatTemplateContentFormat": "xml"}])
def test_bad_values_are_refused_by_both(tok: dict[str, Any]) -> None:
    body = cpool(tokenizer=tok)
    with pytest.raises(jsonschema.ValidationError):
        validate_pool(copy.deepcopy(body))
    with pytest.raises(InvalidSpec):
        parse_pool("p", body)


class Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def emit(self, ps: Any, type_: str, reason: str, message: str) -> None:
        self.seen.append((reason, message))


def reconciler() -> tuple[Reconciler, Events, Router]:
    router = Router(prompts=None)
    events = Events()
    return Reconciler(router, namespace="ns", events=events, clock=lambda: 0.0), events, router


def test_the_pool_loads_its_files_and_routes_chat_exactly(tmp_path: Path) -> None:
    folder = model_folder(tmp_path)
    rec, events, router = reconciler()
    asyncio.run(rec.on_pool_event("ADDED", cpool(tokenizer={"path": str(folder)})))
    pool = router.pools["p"]
    assert pool.own_prompts and pool.prompts is not None and not events.seen
    req = parse_openai_body("/v1/chat/completions", json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi there hi"}]}).encode())
    fp = router.fingerprint(req, pool)
    assert fp.fallback is None and fp.tokens == 4 and fp.blocks == 2  # <bos> hi there hi


def test_unreadable_files_are_an_event_and_never_borrow_the_gateways(tmp_path: Path) -> None:
    rec, events, router = reconciler()
    router.prompts = object()  # the gateway's --tokenizer: another model's, maybe
    asyncio.run(rec.on_pool_event("ADDED", cpool(tokenizer={"path": str(tmp_path / "no")})))
    pool = router.pools["p"]
    assert pool.prompts is None and events.seen[0][0] == "TokenizerUnavailable"
    req = parse_openai_body("/v1/completions", b'{"model": "m", "prompt": "hi"}')
    assert router.fingerprint(req, pool).fallback == "no_tokenizer"


def test_no_template_is_a_warning_and_chat_falls_back(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, template=None)
    rec, events, router = reconciler()
    asyncio.run(rec.on_pool_event("ADDED", cpool(tokenizer={"path": str(folder)})))
    assert events.seen[0][0] == "NoChatTemplate"
    req = parse_openai_body("/v1/chat/completions", json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode())
    assert router.fingerprint(req, router.pools["p"]).fallback == "no_chat_template"
