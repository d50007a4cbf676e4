"""Randomised chat conversations of the kinds users send, for checking the gateway's renderer
against a real engine: system prompts (string, parts, developer role, Claude Code's billing
header), several turns with assistant replies (text, parts, empty), unicode, special-token
text, whitespace at the edges, long documents, and the request options that change the
prompt (no generation prompt, continuing the last message, special tokens, template
kwargs). A few break the template's rules on purpose: both sides must refuse those.
"""

from __future__ import annotations

import random
from typing import Any

WORDS = ("cache", "prefix", "router", "worker", "token", "block", "engine", "latency",
         "policy", "request", "reply", "parcel", "weight", "label", "return", "route", "queue",
         "batch", "model", "prompt", "answer", "question", "document", "section", "clause",
         "summary")
UNICODE = ("Ünïcödé", "naïve café", "日本語のテキスト", "中文字符", "한국어", "😀🚀✨",
           "Ελληνικά", "русский текст", "עברית", "العربية", "e\u0301", "ﬁ ligature", "\u00a0nbsp",
           "तमिऴ्", "🧑‍🚀")
SPECIAL_TEXT = ("<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>")
EDGES = ("", " ", "\n", "  \n", "\t", "\n\n ")


def _sentence(rng: random.Random, n: int) -> str:
    words = []
    for _ in range(n):
        r = rng.random()
        if r < 0.06:
            words.append(rng.choice(UNICODE))
        elif r < 0.08:
            words.append(rng.choice(SPECIAL_TEXT))
        else:
            words.append(rng.choice(WORDS))
    text = " ".join(words)
    return text[:1].upper() + text[1:] + rng.choice((".", "?", "!", ":", "", "\n"))


def _text(rng: random.Random, long_doc: bool = False) -> str:
    if long_doc:
        body = "\n\n".join(f"§{k}. " + " ".join(_sentence(rng, rng.randint(8, 20))
                                                for _ in range(rng.randint(2, 5)))
                           for k in range(rng.randint(4, 10)))
        return "Document:\n" + body
    text = " ".join(_sentence(rng, rng.randint(2, 14)) for _ in range(rng.randint(1, 3)))
    return rng.choice(EDGES) + text + rng.choice(EDGES)


def _content(rng: random.Random, text: str) -> Any:
    r = rng.random()
    if r < 0.7:
        return text
    cut = rng.randint(0, len(text))
    parts = [{"type": "text", "text": text[:cut]}, {"type": "text", "text": text[cut:]}]
    if rng.random() < 0.3:
        parts.append({"type": "text", "text": _text(rng)})
    return parts


def _system(rng: random.Random) -> dict[str, Any] | None:
    r = rng.random()
    if r < 0.3:
        return None
    text = _text(rng, long_doc=rng.random() < 0.25)
    if r < 0.4:
        return {"role": "developer", "content": text}
    if r < 0.45:
        return {"role": "system", "content": "x-anthropic-billing-header: cch=1234\n" + text}
    return {"role": "system", "content": _content(rng, text)}


def conversation(rng: random.Random, *, max_turns: int = 4) -> dict[str, Any]:
    """One chat request body (without ``model``)."""
    msgs: list[dict[str, Any]] = []
    system = _system(rng)
    if system:
        msgs.append(system)
    turns = rng.randint(1, max_turns)
    for t in range(turns):
        user: dict[str, Any] = {"role": "user",
                                "content": _content(rng, _text(rng, rng.random() < 0.1))}
        if rng.random() < 0.1:
            user["name"] = "alice"
        msgs.append(user)
        if t < turns - 1 or rng.random() < 0.2:
            r = rng.random()
            content: Any = _content(rng, _text(rng)) if r > 0.08 else None
            msgs.append({"role": "assistant", "content": content})
    body: dict[str, Any] = {"messages": msgs}
    last = msgs[-1]
    if last["role"] == "assistant" and last["content"] and rng.random() < 0.6:
        body["add_generation_prompt"] = False
        body["continue_final_message"] = True
    elif rng.random() < 0.1:
        body["add_generation_prompt"] = False
    if rng.random() < 0.08:
        body["add_special_tokens"] = True
    if rng.random() < 0.08:
        body["chat_template_kwargs"] = rng.choice(({"bos_token": "<bos><bos>"}, {"foo": 1},
                                                   {"enable_thinking": False}))
    if rng.random() < 0.03:  # two user turns in a row: Gemma's template refuses it
        body["messages"] = [*msgs, {"role": "user", "content": "again"},
                            {"role": "user", "content": "and again"}]
    return body


def session(rng: random.Random, turns: int) -> list[dict[str, Any]]:
    """A conversation growing turn by turn, as a chat client resends it: each request is
    the previous one plus the model's reply and a new user message (a shared prefix)."""
    system = {"role": "system", "content": _text(rng, long_doc=True)[:1500]}
    msgs: list[dict[str, Any]] = [system, {"role": "user", "content": _text(rng)}]
    out = [{"messages": list(msgs)}]
    for _ in range(turns - 1):
        msgs += [{"role": "assistant", "content": _text(rng)},
                 {"role": "user", "content": _content(rng, _text(rng))}]
        out.append({"messages": list(msgs)})
    return out
