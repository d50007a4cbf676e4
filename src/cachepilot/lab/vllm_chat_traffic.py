"""The chat study's traffic (:mod:`cachepilot.lab.vllm_chat_study`): multi-turn sessions
that share system prompts (by Zipf popularity) and resend a growing history, assistant turns
included, some unicode, some content as OpenAI text parts; and which requests bypass the
gateway. Seeded: the same requests for every policy of a seed."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cachepilot.lab.vllm_chat_study import ChatStudyConfig

TOPICS = ("parcel", "invoice", "refund", "label", "delivery", "warehouse", "customs", "route",
          "account", "password", "subscription", "discount", "courier", "pallet", "address",
          "tracking", "insurance", "weight", "battery", "contract")
WORDS = ("the", "a", "of", "and", "to", "in", "is", "for", "on", "with", "as", "by", "at",
         "from", "that", "this", "be", "are", "it", "or", "not", "when", "must", "can", "will",
         "customer", "order", "price", "day", "week", "team", "policy", "request", "answer",
         "short", "clear", "free", "late", "damaged", "express", "standard", "international",
         "local", "office", "store", "online", "phone", "email", "form", "number", "code")
UNICODE = ("Ünïcödé", "naïve café", "Zürich", "São Paulo", "Kraków", "東京", "日本語の説明",
           "中文", "한국어", "Ελληνικά", "русский", "עברית", "العربية", "😀", "🚀📦", "✅",
           "→", "€ 12,50", "£7", "½ kg", "ﬁle", "e\u0301", "\u00a0")
COMPANIES = ("Nordlicht Logistik GmbH", "Café Ünïcödé Deliveries", "東京エクスプレス",
             "Ωmega Parcels", "Lakeside Freight", "Børge & Søn", "Rapid Courier Co.",
             "Saint-Étienne Transports")


def _sentence(rng: random.Random, n: int, unicode: float) -> str:
    out = []
    for _ in range(n):
        r = rng.random()
        out.append(rng.choice(UNICODE) if r < unicode else
                   rng.choice(TOPICS) if r < unicode + 0.2 else rng.choice(WORDS))
    text = " ".join(out)
    return text[:1].upper() + text[1:] + rng.choice((".", ".", ".", "?", "!", ":"))


def _paragraph(rng: random.Random, words: int, unicode: float) -> str:
    out: list[str] = []
    left = words
    while left > 0:
        n = min(left, rng.randint(6, 18))
        out.append(_sentence(rng, n, unicode))
        left -= n
    return " ".join(out)


def system_prompt(k: int, words: int) -> str:
    """Shared system prompt ``k``: an assistant's role, rules and a policy text."""
    rng = random.Random(f"system-{k}")
    company = COMPANIES[k % len(COMPANIES)]
    rules = "\n".join(f"{i + 1}. {_sentence(rng, rng.randint(6, 14), 0.02)}"
                      for i in range(rng.randint(3, 6)))
    head = (f"You are the customer support assistant of {company}. Answer in the customer's "
            "language, in at most three sentences, and never invent a tracking number.\n\n"
            f"Rules:\n{rules}\n\nPolicies:\n")
    body = "\n\n".join(_paragraph(rng, words // 3, 0.02) for _ in range(3))
    return head + body


@dataclass(frozen=True)
class ChatRequest:
    """One turn of a session: the body sent (the whole history so far), where it belongs."""

    index: int  # its place in the phase's order
    session: int
    turn: int  # 0 for the session's first request
    body: dict[str, Any]
    after: int | None = None  # the index of the session's previous turn (answered first)


def _content(rng: random.Random, text: str, parts: float) -> Any:
    """A message's content: the string, or (a share ``parts``) OpenAI text parts."""
    if rng.random() >= parts:
        return text
    cut = text.rfind(" ", 0, max(1, len(text) // 2))
    if cut <= 0:
        return [{"type": "text", "text": text}]
    return [{"type": "text", "text": text[:cut]}, {"type": "text", "text": text[cut:]}]


def sessions(cfg: ChatStudyConfig, seed: int, model: str) -> list[ChatRequest]:
    """The phase's requests for ``seed``, in the order they are sent: sessions (a system
    prompt by Zipf popularity, or none; 2 to ``max_turns`` turns) interleaved, ``open``
    sessions at a time, each request the session's whole history plus a new user message,
    with the assistant's earlier replies (made up here: the study generates one token)."""
    rng = random.Random(seed)
    weights = [1 / (k + 1) ** cfg.zipf for k in range(cfg.systems)]
    out: list[ChatRequest] = []
    live: list[dict[str, Any]] = []
    last: dict[int, int] = {}
    n_sessions = 0

    def start() -> dict[str, Any]:
        nonlocal n_sessions
        msgs: list[dict[str, Any]] = []
        if rng.random() >= cfg.no_system:
            k = rng.choices(range(cfg.systems), weights)[0]
            msgs.append({"role": "system", "content": system_prompt(k, cfg.system_words)})
        n_sessions += 1
        return {"id": n_sessions - 1, "messages": msgs, "turns": rng.randint(2, cfg.max_turns),
                "turn": 0}

    while len(out) < cfg.requests:
        while len(live) < cfg.open_sessions:
            live.append(start())
        s = rng.choice(live)
        msgs = s["messages"]
        if s["turn"]:
            reply = _paragraph(rng, rng.randint(*cfg.reply_words), cfg.unicode)
            msgs.append({"role": "assistant", "content": _content(rng, reply, cfg.parts)})
        words = rng.randint(*cfg.user_words)
        text = _paragraph(rng, words, cfg.unicode)
        if rng.random() < cfg.documents:
            text += "\n\nDocument:\n" + "\n\n".join(
                _paragraph(rng, rng.randint(40, 70), cfg.unicode) for _ in range(2))
        msgs.append({"role": "user", "content": _content(rng, text, cfg.parts)})
        body = {"model": model, "messages": [dict(m) for m in msgs], "max_tokens": 1,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        i = len(out)
        out.append(ChatRequest(i, s["id"], s["turn"], body, last.get(s["id"])))
        last[s["id"]] = i
        s["turn"] += 1
        if s["turn"] >= s["turns"]:
            live.remove(s)
    return out


def outside_requests(cfg: ChatStudyConfig, seed: int, workers: list[str]) -> dict[int, str]:
    """Which of the phase's requests bypass the gateway, and to which worker: the same for
    every policy of a seed."""
    rng = random.Random(seed * 7919 + 1)
    return {i: workers[rng.randrange(len(workers))] for i in range(cfg.requests)
            if rng.random() < cfg.outside}
