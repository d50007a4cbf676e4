"""Prompt text for drivers that send real HTTP requests (the load generator, the real-model
experiment, the engines' calibration): a simulated request's segments
(:mod:`cachepilot.sim.workloads`) as words, each segment's text a pure function of its key,
so requests that share segments share their text as they share their tokens.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cachepilot.sim.workloads import SimRequest

# The one word list prompt text is made of (the load generator, the real-model experiment).
WORDS = (
    "the", "of", "and", "to", "in", "is", "for", "on", "with", "as", "by", "at", "from",
    "that", "this", "be", "are", "it", "an", "or", "was", "kernel", "cache", "block", "prefix",
    "token", "batch", "queue", "worker", "model", "prompt", "latency", "envoy", "route", "pool",
    "decode", "prefill", "memory", "schedule", "request", "response", "stream", "gateway",
    "system", "river", "mountain", "copper", "window", "garden", "silver", "engine", "harbor",
    "lantern", "violet",
)


def words(rng: random.Random, n: int) -> str:
    """``n`` words drawn from :data:`WORDS`."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


def segment_text(key: str, tokens: int, chars_per_token: float = 4.0) -> str:
    """About ``tokens`` tokens of text (``tokens × chars_per_token`` characters), a pure
    function of ``key``: segments that share a key share their text."""
    rng = random.Random(key)
    n = max(1, round(tokens * chars_per_token))
    out: list[str] = []
    size = 0
    while size <= n:  # the joined words are size - 1 characters long
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n]


def chat_messages(req: SimRequest, chars_per_token: float = 4.0) -> list[dict[str, str]]:
    """A request as chat messages: every segment but the last is the system message (the
    shared part), the last is the user's."""
    texts = [segment_text(k, n, chars_per_token) for k, n in req.segments]
    *shared, own = texts if len(texts) > 1 else ["", *texts]
    return [{"role": "system", "content": " ".join(shared)},
            {"role": "user", "content": f"q{req.id}: {own}"}]
