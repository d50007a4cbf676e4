"""Our real llama.cpp workers as the simulator models them, and the traffic the real-model
studies send them.

Both sides of the real-worker comparison use these specs: the simulated peers study runs the
workloads on slot engines (:mod:`cachepilot.sim.slot_engine`), and the real-model and
real-peers studies (:mod:`cachepilot.lab`) draw the same requests and send them to real
llama-server workers. They live beside the simulator's workloads, below both.

Traffic for two single-slot llama.cpp workers on 2 CPU cores; the engine is such a worker:
one slot, prefill at the ~2.45 ms/token measured on one thread (docs/real-model.md) in
256-token batches (``-b 256``: /slots shows the progress batch by batch), ~0.1 s of fixed cost
per step, and llama-server's default host-memory prompt cache (8 GiB: ~280 prompts of
Gemma 3 270M's ~29 MiB state), so a prompt that leaves the slot is kept, not lost; Gemma 3's
512-token sliding window, so a match is reused only up to a context checkpoint (about a
batch short of the held prompt's end).
"""

from __future__ import annotations

from cachepilot.sim.engine import EngineConfig
from cachepilot.sim.workloads import Dist, WorkloadSpec

LLAMA_WORKLOADS: dict[str, WorkloadSpec] = {
    # Two shared documents of ~550 tokens (~1.7 s cold): two single-slot workers hold both
    # once partitioned, one holds only one; 15 % of requests bring a one-off document.
    "shared": WorkloadSpec("shared_prefix", rate=0.4, groups=2, prefix=Dist(550),
                           suffix=Dist(22), output=Dist(8), p_unique=0.15),
    # One system prompt, then one of 8 documents by Zipf popularity (a few hot, a long tail
    # that two one-slot workers cannot all hold); more work per request: a lower rate.
    "hotspot": WorkloadSpec("hotspot", rate=0.3, system_tokens=60, docs=8,
                            doc=Dist(480, 0.15, 360, 600), zipf_s=1.1,
                            question=Dist(22), output=Dist(8)),
}
LLAMA_CACHE_PROMPTS = 8192 // 29  # --cache-ram 8192 over one prompt's state (tooling/llamacpp)
LLAMA_ENGINE = EngineConfig(slots=1, num_blocks=256, prefill_ms_per_token=2.45,
                            step_ms=100.0, decode_ms_per_seq=5.0, max_batched_tokens=256,
                            prompt_cache=LLAMA_CACHE_PROMPTS, sliding_window=512)
