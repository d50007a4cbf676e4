"""A model's files → the engine's prompt path (:class:`cachepilot.core.vllm_prompt.VllmPrompts`):
the one place they are read from disk, so the routing core stays free of I/O.

Where each piece comes from, in the order vLLM 0.32 and transformers 5 look:

- the tokenizer: ``tokenizer.json`` (a model folder, or the file itself), encoded with the
  ``tokenizers`` library as the engine's Hugging Face fast tokenizer does;
- the named special tokens a template reads (``bos_token``, ``eos_token``, …):
  ``tokenizer_config.json`` beside it;
- the chat template: the file the engine was started with (``--chat-template``), else the
  folder's ``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template`` (a
  string, or named templates: the ``default`` one, as transformers picks without tools).
  None found: chat requests fall back to the approximate directory (counted), as vLLM
  itself refuses them (400).

In Kubernetes the same files are mounted into the gateway's pod (docs/kubernetes.md) and a
pool names them in ``spec.routing.tokenizer``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cachepilot.core.chat.template import ChatTemplate
from cachepilot.core.vllm_prompt import VllmPrompts

# transformers' SPECIAL_TOKENS_ATTRIBUTES: the named tokens special_tokens_map holds (v5).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                  "cls_token", "mask_token")


class ModelFilesError(ValueError):
    """A tokenizer or template that cannot be read: one line saying which and why."""


def tokenizer_file(path: str | Path) -> Path:
    """``tokenizer.json`` itself, or inside a model folder."""
    p = Path(path)
    f = p / "tokenizer.json" if p.is_dir() else p
    if not f.is_file():
        raise ModelFilesError(f"no tokenizer.json at {path}")
    return f


def special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens of a ``tokenizer_config.json`` (strings or AddedToken
    objects with a ``content``)."""
    out = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelFilesError(f"cannot read {path}: {exc}") from None
    return data if isinstance(data, dict) else {}


def template_text(folder: Path, config: Mapping[str, Any],
                  chat_template: str | Path | None = None) -> str | None:
    """The chat template vLLM would use for a model folder, or None."""
    if chat_template is not None:
        try:  # text mode, universal newlines: as vLLM's load_chat_template reads it
            with open(chat_template, encoding="utf-8") as f:
                return f.read()
        except OSError as exc:
            raise ModelFilesError(f"cannot read the chat template {chat_template}: "
                                  f"{exc.strerror or exc}") from None
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    tpl = config.get("chat_template")
    if isinstance(tpl, list):  # named templates
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, Mapping)}
        tpl = named.get("default")
    return tpl if isinstance(tpl, str) else None


def load_prompts(tokenizer: str | Path, *, chat_template: str | Path | None = None,
                 content_format: str = "auto", lora_adapters: Mapping[str, str] | None = None,
                 served_models: Sequence[str] = ()) -> VllmPrompts:
    """The prompt path of the model whose tokenizer (file or folder) is ``tokenizer``.
    ``lora_adapters``: adapter name → path exactly as the engine's ``--lora-modules`` names
    it (it is part of every block hash). Raises :class:`ModelFilesError`."""
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - depends on the installed extras
        raise ModelFilesError("exact vLLM hashing needs: pip install 'cachepilot[tokenizers]'"
                              ) from None
    tok_path = tokenizer_file(tokenizer)
    try:
        tok = Tokenizer.from_file(str(tok_path))
    except Exception as exc:  # tokenizers raises its own exception types
        raise ModelFilesError(f"cannot load {tok_path}: {exc}") from None
    config = _read_json(tok_path.parent / "tokenizer_config.json")
    text = template_text(tok_path.parent, config, chat_template)
    template = None
    if text is not None:
        try:
            template = ChatTemplate(text, special_tokens(config), content_format)
        except Exception as exc:  # a Jinja syntax error, an unknown content format
            raise ModelFilesError(f"cannot compile the chat template: {exc}") from None

    def encode(prompt: str, add_special_tokens: bool) -> list[int]:
        return tok.encode(prompt, add_special_tokens=add_special_tokens).ids

    return VllmPrompts(encode, template, dict(lora_adapters or {}),
                       frozenset(served_models))


def parse_lora_modules(values: Sequence[str]) -> dict[str, str]:
    """``name=path`` pairs (vLLM's ``--lora-modules`` syntax) → name → path."""
    out = {}
    for v in values:
        name, sep, path = v.partition("=")
        if not sep or not name or not path:
            raise ModelFilesError(f"a LoRA adapter is name=path, as vLLM's --lora-modules: "
                                  f"{v!r}")
        out[name] = path
    return out
