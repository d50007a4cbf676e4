"""What a vLLM engine prefills for a request, and the extra keys its block hashes carry: the
token ids and the (LoRA, cache_salt) identity that make the gateway's block hashes the
engine's own (:func:`cachepilot.core.fingerprint.vllm_block_hashes`).

vLLM 0.32's path, reproduced here for text requests:

- ``/v1/chat/completions``: the request's fields become the template's variables
  (``ChatCompletionRequest.build_chat_params``, ``merge_kwargs``: ``add_generation_prompt``
  and ``continue_final_message`` win over the same keys of ``chat_template_kwargs``), the
  messages are normalised (:mod:`cachepilot.core.chat.messages`), the template is rendered
  (:mod:`cachepilot.core.chat.template`), and the text is tokenised with
  ``add_special_tokens`` as the request says (default False: the template writes BOS).
- ``/v1/completions``: a text prompt is tokenised with ``add_special_tokens`` (default True);
  token-id prompts are used as they are.
- LoRA: the request's ``model`` naming an adapter puts ``("lora", name, path)`` into every
  block's hash, with the adapter's path *as the server was given it*; ``cache_salt`` puts
  ``("cache_salt", salt)`` into the first block's (``vllm/v1/core/kv_cache_utils.py``,
  ``generate_block_hash_extra_keys``).

What is not reproduced raises :class:`NotExact` (multimodal parts, ``prompt_embeds``,
``truncate_prompt_tokens``, a per-request template, tools or kwargs a template reads in a form
only vLLM's pydantic models produce, an adapter the gateway was not told of): the router then
uses the approximate directory for that request and counts the reason.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from cachepilot.core.chat.messages import MEDIA_KEYS, TEXT_PARTS, conversation
from cachepilot.core.chat.template import ChatTemplate, NotExact
from cachepilot.core.fingerprint import (
    BlockConfig,
    Fingerprint,
    Tokenizer,
    cached_none_hash,
    fingerprint,
    vllm_block_hashes,
)
from cachepilot.core.request import InferenceRequest

# (text, add_special_tokens) → token ids, as the engine's Hugging Face fast tokenizer encodes.
Encode = Callable[[str, bool], Sequence[int]]

# Keys of chat_template_kwargs that change what vLLM does beyond the template's variables
# (a different template, ids instead of text, tool schemas as pydantic dumps them).
OPAQUE_KWARGS = ("chat_template", "tokenize", "tools", "return_assistant_tokens_mask")
SALT_FORBIDDEN = ("@", "/", "\\", "\x00")  # vllm/entrypoints/generate/base/protocol.py
SALT_MAX = 128


@dataclass(frozen=True, slots=True)
class EnginePrompt:
    """The ids the engine prefills and the extra keys of their block hashes."""

    token_ids: tuple[int, ...]
    lora: tuple[str, str] | None = None  # (adapter name, path as the engine was given it)
    cache_salt: str | None = None


@dataclass(frozen=True)
class VllmPrompts:
    """One model's prompt path: its tokenizer, its chat template (None: chat is approximate),
    its LoRA adapters (name → path string exactly as ``--lora-modules`` gave it) and the
    base model's served names (empty: any name that is not an adapter is the base)."""

    encode: Encode
    template: ChatTemplate | None = None
    lora_adapters: Mapping[str, str] = field(default_factory=dict)
    served_models: frozenset[str] = frozenset()

    def prompt(self, req: InferenceRequest) -> EnginePrompt:
        """The engine's prompt for ``req``, or :class:`NotExact`."""
        body: Mapping[str, Any] = req.body or {}
        lora = self._lora(req.model)
        salt = _cache_salt(body)
        if body.get("truncate_prompt_tokens") is not None:
            raise NotExact("truncate_prompt_tokens")
        ids = self._chat_ids(body) if req.kind == "chat" else self._completion_ids(req, body)
        return EnginePrompt(tuple(ids), lora, salt)

    def _lora(self, model: str) -> tuple[str, str] | None:
        path = self.lora_adapters.get(model)
        if path is not None:
            return model, path
        if self.served_models and model not in self.served_models:
            raise NotExact("unknown_model", f"{model!r} is neither the base model nor a "
                           "LoRA adapter the gateway knows the path of")
        return None

    def _completion_ids(self, req: InferenceRequest, body: Mapping[str, Any]) -> Sequence[int]:
        if body.get("prompt_embeds") is not None:
            raise NotExact("prompt_embeds")
        if req.token_ids is not None:
            return req.token_ids
        return self.encode(req.prompt, _flag(body, "add_special_tokens", True))

    def _chat_ids(self, body: Mapping[str, Any]) -> Sequence[int]:
        messages = body.get("messages")
        reused = _forwarded_ids(body)
        if reused is not None:
            return reused
        tpl = self.template
        if tpl is None:
            raise NotExact("no_chat_template")
        if body.get("chat_template") is not None:
            raise NotExact("request_chat_template")
        user = body.get("chat_template_kwargs") or {}
        if not isinstance(user, Mapping):
            raise NotExact("invalid_request", "chat_template_kwargs is not an object")
        for key in OPAQUE_KWARGS:
            if user.get(key) is not None:
                raise NotExact("chat_template_kwargs", key)
        add_gen = _flag(body, "add_generation_prompt", True)
        cont = _flag(body, "continue_final_message", False)
        documents = body.get("documents")
        if documents is None:
            documents = user.get("documents")
        if body.get("tools") and tpl.uses("tools"):
            raise NotExact("tools")  # vLLM passes pydantic's dump of them: not reproduced
        overrides = {k: v for k, v in user.items()
                     if k not in ("add_generation_prompt", "continue_final_message",
                                  "documents")}
        effort = body.get("reasoning_effort")
        if effort not in (None, "auto"):
            overrides["reasoning_effort"] = effort
            if "enable_thinking" not in user:
                overrides["enable_thinking"] = effort != "none"
        conv = conversation(messages, tpl.content_format,  # type: ignore[arg-type]
                            supports_developer=tpl.supports_developer)
        text = tpl.render(conv, add_generation_prompt=add_gen, continue_final_message=cont,
                          documents=documents if tpl.uses("documents") else None,
                          kwargs=tpl.template_kwargs(overrides))
        return self.encode(text, _flag(body, "add_special_tokens", False))


def _flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise NotExact("invalid_request", f"{key} is not a boolean")
    return value


def _cache_salt(body: Mapping[str, Any]) -> str | None:
    """vLLM's validation (a 400 otherwise, and then nothing is cached)."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if (not isinstance(salt, str) or not salt or len(salt) > SALT_MAX
            or any(c in salt for c in SALT_FORBIDDEN)):
        raise NotExact("invalid_request", "cache_salt")
    return salt


def _non_text(part: Any) -> bool:
    """vLLM's ``has_non_text_content`` for one part."""
    if not isinstance(part, Mapping):
        return False
    ptype = part.get("type", "text")
    return bool(MEDIA_KEYS & part.keys()) or not isinstance(ptype, str) or (
        ptype not in TEXT_PARTS and ptype != "tool_reference")


def _forwarded_ids(body: Mapping[str, Any]) -> list[int] | None:
    """Disaggregated serving: ``kv_transfer_params.prompt_token_ids`` are prefilled as they
    are, without templating, unless ``echo`` is set or a message has non-text content
    (``_reused_prompt_token_ids`` in vllm/renderers/online_renderer.py)."""
    kv = body.get("kv_transfer_params")
    ids = kv.get("prompt_token_ids") if isinstance(kv, Mapping) else None
    if ids is None or body.get("echo"):
        return None
    for msg in body.get("messages") or ():
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if isinstance(content, list) and any(_non_text(p) for p in content):
            return None
    if not isinstance(ids, list) or not ids or any(type(t) is not int or t < 0 for t in ids):
        raise NotExact("invalid_request", "kv_transfer_params.prompt_token_ids")
    return ids


def engine_fingerprint(req: InferenceRequest, model: str, block: BlockConfig,
                       prompts: VllmPrompts | None,
                       tokenizer: Tokenizer | None = None) -> Fingerprint:
    """``req``'s fingerprint in a pool whose engines are vLLM with ``block.vllm_seed``: the
    engine's own block hashes when its prompt is reproduced exactly, else the approximate
    scheme's (xxh3 over the flattened prompt's tokens) with ``fallback`` naming why, so the
    router matches it against the routing-learned directory only and never claims an
    exact hit it cannot know."""
    assert block.vllm_seed is not None
    reason = "no_tokenizer"
    if prompts is not None:
        try:
            p = prompts.prompt(req)
        except NotExact as exc:
            reason = exc.reason
        else:
            hashes = vllm_block_hashes(p.token_ids, block.block_size,
                                       cached_none_hash(block.vllm_seed), lora=p.lora,
                                       cache_salt=p.cache_salt)
            return Fingerprint(tuple(hashes), len(p.token_ids), block.block_size)
        if tokenizer is None:
            tokenizer = functools.partial(_encode_plain, prompts.encode)
    approx = fingerprint(model, replace(block, vllm_seed=None), text=req.prompt,
                         token_ids=req.token_ids, tokenizer=tokenizer)
    return replace(approx, fallback=reason)


def _encode_plain(encode: Encode, text: str) -> Sequence[int]:
    return encode(text, False)
