"""Where the gateway finds a model's chat template and special tokens, in the order vLLM and
transformers look: the file the engine was started with, the folder's chat_template.jinja,
tokenizer_config.json's chat_template (a string, or named templates: the default one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cachepilot.datalayer.model_files import (
    ModelFilesError,
    load_prompts,
    parse_lora_modules,
    special_tokens,
    template_text,
    tokenizer_file,
)


def folder(tmp: Path, config: dict | None = None, jinja: str | None = None) -> Path:
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(
        str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps(config or {}))
    if jinja is not None:
        (tmp / "chat_template.jinja").write_text(jinja)
    return tmp


def test_the_engines_file_wins_then_the_folders_then_the_config(tmp_path: Path) -> None:
    f = folder(tmp_path, {"chat_template": "from config"}, jinja="from jinja")
    given = tmp_path / "given.jinja"
    given.write_bytes(b"line one\r\nline two\n")  # read as vLLM reads it: universal newlines
    assert template_text(f, json.loads((f / "tokenizer_config.json").read_text()),
                         given) == "line one\nline two\n"
    assert template_text(f, {"chat_template": "from config"}) == "from jinja"
    (f / "chat_template.jinja").unlink()
    assert template_text(f, {"chat_template": "from config"}) == "from config"
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "d"}]
    assert template_text(f, {"chat_template": named}) == "d"
    assert template_text(f, {}) is None


def test_special_tokens_are_the_named_ones_strings_or_added_tokens() -> None:
    config = {"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>",
              "additional_special_tokens": ["<x>"], "pad_token": None}
    assert special_tokens(config) == {"bos_token": "<s>", "eos_token": "</s>"}


def test_loading_errors_say_which_file(tmp_path: Path) -> None:
    with pytest.raises(ModelFilesError, match=r"no tokenizer\.json"):
        tokenizer_file(tmp_path)
    f = folder(tmp_path, jinja="{% for %}")
    with pytest.raises(ModelFilesError, match="cannot compile the chat template"):
        load_prompts(f)
    with pytest.raises(ModelFilesError, match="cannot read the chat template"):
        load_prompts(f, chat_template=tmp_path / "missing.jinja")
    with pytest.raises(ModelFilesError, match="name=path"):
        parse_lora_modules(["tiny"])
    assert parse_lora_modules(["a=/x=y"]) == {"a": "/x=y"}


def test_a_folder_or_its_tokenizer_json(tmp_path: Path) -> None:
    f = folder(tmp_path, {"bos_token": "<s>"}, jinja="{{ bos_token }}")
    for where in (f, f / "tokenizer.json"):
        p = load_prompts(where, lora_adapters={"t": "/a"}, served_models=["m"])
        assert p.template is not None and p.template.special_tokens == {"bos_token": "<s>"}
        assert p.encode("a", False) == [0] and p.lora_adapters == {"t": "/a"}
        assert p.served_models == frozenset({"m"})
