"""The real-model experiment's traffic: shared documents, one-off documents, short questions."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from cachepilot.tooling.llamacpp.worker import MODEL_NAME

# -- the workload ---------------------------------------------------------------------------
_WORDS = (
    "the", "of", "and", "to", "in", "is", "for", "on", "with", "as", "by", "at", "from",
    "that", "this", "be", "are", "it", "an", "or", "was", "kernel", "cache", "block", "prefix",
    "token", "batch", "queue", "worker", "model", "prompt", "latency", "envoy", "route", "pool",
    "decode", "prefill", "memory", "schedule", "request", "response", "stream", "gateway",
    "system", "river", "mountain", "copper", "window", "garden", "silver", "engine", "harbor",
    "lantern", "violet",
)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


@dataclass(frozen=True)
class RealWorkload:
    """Sized for 2 CPU cores: a few shared system documents (~550 tokens each, ~1.7 s cold
    at one thread) each followed by a short unique question, plus one-off documents that
    nothing else shares. Open-loop Poisson arrivals, streamed chat completions."""

    requests: int = 60
    rate: float = 0.4  # requests/s
    # Shared documents: two single-slot workers hold both once they are partitioned; one
    # worker holds only one, so placement decides the hit rate.
    groups: int = 2
    doc_words: int = 500
    question_words: int = 20
    p_unique: float = 0.15  # share of requests with a one-off document
    max_tokens: int = 8
    seed: int = 11

    def typical_prompt(self) -> str:
        """The flattened text of a shared-document request, as the gateway hashes it."""
        from cachepilot.core.request import flatten_messages

        body = next(b for label, b in self.bodies() if label.startswith("shared"))
        return flatten_messages(body["messages"])

    def bodies(self) -> list[tuple[str, dict[str, Any]]]:
        """(document label, request body) for each request, the same for every policy."""
        rng = random.Random(self.seed)
        docs = [f"[shared doc {g}] " + _words(rng, self.doc_words) for g in range(self.groups)]
        out = []
        for i in range(self.requests):
            if rng.random() < self.p_unique:
                label, doc = f"unique-{i}", f"[one-off doc {i}] " + _words(rng, self.doc_words)
            else:
                g = rng.randrange(self.groups)
                label, doc = f"shared-{g}", docs[g]
            body = {"model": MODEL_NAME, "stream": True, "max_tokens": self.max_tokens,
                    "ignore_eos": True, "stream_options": {"include_usage": True},
                    "messages": [{"role": "system", "content": doc},
                                 {"role": "user", "content": f"q{i}: " +
                                  _words(rng, self.question_words)}]}
            out.append((label, body))
        return out
