"""The real-worker studies' traffic (real-model, real-peers), as a simulator workload: a few
shared documents, some one-off documents nothing else shares, each followed by a short
question; Poisson arrivals, streamed chat completions for llama-server. Rendered as text with
the simulator's word list. The specs are :data:`cachepilot.sim.llamacpp.LLAMA_WORKLOADS` (the
simulated peers study runs the same)."""

from __future__ import annotations

from typing import Any

from cachepilot.sim.llamacpp import LLAMA_WORKLOADS
from cachepilot.sim.workloads import SimRequest, WorkloadSpec, generate
from cachepilot.tooling.llamacpp.worker import MODEL_NAME
from cachepilot.tooling.loadgen import CHAT, COMPLETIONS, chat_body, completion_body

# Sized for 2 CPU cores (the spec and why: cachepilot.sim.llamacpp.LLAMA_WORKLOADS).
WORKLOAD = LLAMA_WORKLOADS["shared"]
REQUESTS = 60
SEED = 11
# Gemma 3's tokenizer on this text: about 5.8 UTF-8 bytes per token (calibration measures it).
CHARS_PER_TOKEN = 5.8


def requests(spec: WorkloadSpec = WORKLOAD, n: int = REQUESTS, seed: int = SEED
             ) -> list[SimRequest]:
    """The first ``n`` arrivals of ``spec`` (drawn over long enough for ``n``)."""
    return generate(spec.with_(duration=1.5 * n / spec.rate + 10.0), seed).requests[:n]


def label(req: SimRequest) -> str:
    """``shared-G`` for shared document G, ``unique-I`` for request I's own document,
    ``doc-D`` for a hotspot workload's document D."""
    kind, num = req.group[0], req.group[1:]
    return {"g": "shared", "u": "unique", "d": "doc"}.get(kind, kind) + f"-{num}"


# The OpenAI API each study can use: its path, and how a request becomes its body.
APIS = {"chat": CHAT, "completions": COMPLETIONS}


def body(req: SimRequest, api: str = "chat", model: str = MODEL_NAME) -> dict[str, Any]:
    """The request for ``api``; generation runs to ``max_tokens`` (``ignore_eos``: both
    llama-server and vLLM take it), so every router's phase decodes the same tokens."""
    make = chat_body if api == "chat" else completion_body
    return make(req, model, CHARS_PER_TOKEN, ignore_eos=True)


def bodies(reqs: list[SimRequest], api: str = "chat", model: str = MODEL_NAME
           ) -> list[tuple[str, dict[str, Any]]]:
    """(document label, request body) for each request, the same for every policy."""
    return [(label(r), body(r, api, model)) for r in reqs]
