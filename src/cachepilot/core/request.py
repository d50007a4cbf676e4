"""OpenAI-style request bodies → the one request shape the router understands."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import orjson

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
INFERENCE_PATHS = (COMPLETIONS_PATH, CHAT_PATH)


class RequestError(Exception):
    """A client error that maps to one HTTP status and a JSON message."""

    def __init__(self, status: int, message: str, *, code: str = "invalid_request",
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.retry_after_s = retry_after_s

    def to_json(self) -> bytes:
        """OpenAI's error envelope, so unmodified clients show the message."""
        return orjson.dumps({"error": {"message": self.message, "type": self.code,
                                       "code": self.status}})


class UnparseableBody(RequestError):
    """The body is not a JSON object: nothing in it can be routed on. A proxy protocol that
    lets the gateway route it anyway sends it by load alone, and the engine answers it
    (it may accept what the gateway's parser refuses)."""


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """What routing needs from a request: the model and the prompt (text or token ids).

    ``prompt`` is the flattened text; ``token_ids`` is set instead when the client sent ids.
    ``fingerprint`` may be filled in by a caller that already hashed the prompt (the simulator).
    """

    model: str
    prompt: str = ""
    token_ids: tuple[int, ...] | None = None
    stream: bool = False
    max_tokens: int | None = None
    kind: str = "completion"
    fingerprint: Any = None  # cachepilot.core.fingerprint.Fingerprint, set by the simulator
    # Token offset where the user's own content starts (after shared system text), when the
    # driver knows it (the simulator).
    user_start: int = 0
    # The parsed JSON body, for what the engine's own prompt path reads beyond the prompt
    # (chat fields, cache_salt, add_special_tokens: cachepilot.core.vllm_prompt). Never
    # recorded.
    body: Any = field(default=None, repr=False, compare=False)
    # A hash of the first 100 characters of the first user message (of the prompt, for
    # completions), when the driver knows it (the simulator): what KubeAI's prefix-hash
    # routing keys on; nothing else reads it.
    prefix_key: int | None = None
    # How long this replica held the request for its turn before routing it (ms; the
    # driver sets it: core.spread.ReplicaSpread.hold_s); recorded with the decision.
    turn_ms: float = 0.0
    # Chat: where the last message starts in ``prompt`` (characters; 0: not chat). A
    # llama.cpp worker checkpoints a sliding-window model's cache there (slot_memory).
    last_message_at: int = 0

    def blocks_before_last_message(self, block_bytes: int) -> int:
        """Chat: the full ``block_bytes`` blocks of ``prompt`` before its last message (0 if
        not chat), where llama-server checkpoints (core.slot_memory)."""
        if not self.last_message_at:
            return 0
        return len(self.prompt[:self.last_message_at].encode()) // block_bytes


def inference_path(path: str) -> str | None:
    """The inference endpoint a request path names, ignoring the query string, or None."""
    base = path.split("?", 1)[0].rstrip("/")
    return base if base in INFERENCE_PATHS else None


def flatten_messages(messages: list[Any]) -> str:
    """Chat messages → one string, deterministically and with roles, so shared history is a
    shared prefix. Mirrors what a chat template does without needing the model's template."""
    return "".join(_message_parts(messages))


def _message_parts(messages: list[Any]) -> list[str]:
    """Each message as :func:`flatten_messages` writes it."""
    parts: list[str] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise RequestError(400, f"messages[{i}] must be an object")
        role = msg.get("role")
        if not isinstance(role, str):
            raise RequestError(400, f"messages[{i}].role must be a string")
        parts.append(f"<|{role}|>\n{_content_text(msg.get('content'), i)}\n")
    return parts


def _content_text(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict):
                raise RequestError(400, f"messages[{i}].content parts must be objects")
            if part.get("type") == "text" and isinstance(part.get("text"), str):
                out.append(part["text"])
            else:  # images, audio: their JSON stands in for them, stable across requests
                out.append(orjson.dumps(part, option=orjson.OPT_SORT_KEYS).decode())
        return "".join(out)
    raise RequestError(400, f"messages[{i}].content must be a string or a list of parts")


def _prompt_of(prompt: Any) -> tuple[str, tuple[int, ...] | None]:
    """Completions' ``prompt``: a string, a list of strings, token ids, or lists of ids.
    A batch goes to one worker, so its first prompt carries the prefix that matters."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str) and all(isinstance(p, str) for p in prompt):
            return first, None
        if isinstance(first, int) and all(isinstance(t, int) for t in prompt):
            return "", tuple(prompt)
        if isinstance(first, list) and all(isinstance(t, int) for t in first):
            return "", tuple(first)
    raise RequestError(400, "'prompt' must be a string, a list of strings, or token ids")


def parse_openai_body(path: str, body: bytes) -> InferenceRequest:
    """Parse a /v1/completions or /v1/chat/completions body; raise RequestError on bad input."""
    endpoint = inference_path(path)
    if endpoint is None:
        raise RequestError(404, f"not an inference endpoint: {path}")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise UnparseableBody(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise UnparseableBody(400, "request body must be a JSON object")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(400, "'model' must be a non-empty string")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "'stream' must be a boolean")
    max_tokens = data.get("max_tokens", data.get("max_completion_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                   or max_tokens < 0):
        raise RequestError(400, "'max_tokens' must be a non-negative integer")
    if endpoint == CHAT_PATH:
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "'messages' must be a non-empty list")
        parts = _message_parts(messages)
        prompt = "".join(parts)
        return InferenceRequest(model=model, prompt=prompt, stream=stream,
                                max_tokens=max_tokens, kind="chat", body=data,
                                last_message_at=len(prompt) - len(parts[-1]))
    if "prompt" not in data:
        raise RequestError(400, "'prompt' is required")
    text, ids = _prompt_of(data["prompt"])
    return InferenceRequest(model=model, prompt=text, token_ids=ids, stream=stream,
                            max_tokens=max_tokens, kind="completion", body=data)


_MODEL_RE = re.compile(rb'"model"\s*:\s*"([^"\\]{1,256})"')


def unparsed_request(body: bytes) -> InferenceRequest:
    """What an unparseable body can still say for routing by load: the model it seems to
    name (the first ``"model": "…"`` in its first 64 KB), no prompt."""
    m = _MODEL_RE.search(body[:65536])
    return InferenceRequest(model=m.group(1).decode("utf-8", "replace") if m else "",
                            kind="unparsed")
