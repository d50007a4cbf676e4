"""A slot engine, modelled on llama-server: one prompt's KV per slot, no shared block cache.

Same interface and timing as :class:`~cachepilot.sim.engine.Engine` (one batch per step:
a token per decoding sequence, the rest of the token budget to prefill chunks, oldest
first), different memory (llama.cpp's tools/server/server.cpp):

- ``slots`` slots, each with ``num_blocks // slots`` blocks of context; a request runs in
  one slot, so at most ``slots`` run at once and the rest wait (llama-server defers them).
- A waiting request takes the idle slot whose prompt shares the longest common prefix with
  it, if that is more than ``SLOT_SIMILARITY`` of its prompt (``--slot-prompt-similarity``),
  else the least recently used idle slot (``get_available_slot``). The common prefix is
  reused, at block granularity here (llama.cpp reuses tokens; the directory sees blocks);
  the slot then holds the new prompt, and whatever else it held is gone.
- No KV gauge (llama.cpp exports none); prefix queries and hits count prompt tokens, as its
  ``prompt_tokens_total`` / ``prompt_tokens_cached_total``.

Not modelled: sliding-window models' minimum reusable match (docs/real-model.md), the
host-memory prompt cache (off in our llama tooling), generated tokens in a slot's prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

from cachepilot.core.directory import PrefixDirectory, common_prefix
from cachepilot.sim.engine import Engine, EngineConfig, EngineRequest

SLOT_SIMILARITY = PrefixDirectory.SLOT_SIMILARITY  # the directory models the same rule


@dataclass(slots=True)
class _Slot:
    chain: tuple[int, ...] = ()
    busy: bool = False
    last_used: float = -1.0


class SlotEngine(Engine):
    def __init__(self, config: EngineConfig) -> None:
        if config.slots < 1:
            raise ValueError("a slot engine needs slots >= 1")
        super().__init__(config)
        self.slot_blocks = max(1, config.num_blocks // config.slots)
        self.slots = [_Slot() for _ in range(config.slots)]
        self._slot_of: dict[int, _Slot] = {}  # id(request) → its slot

    def submit(self, req: EngineRequest) -> None:
        need = -(-(req.prompt_tokens + req.max_tokens) // self.cfg.block_size)
        if need > self.slot_blocks:
            raise ValueError(f"request needs {need} KV blocks; a slot has {self.slot_blocks}")
        self.waiting.append(req)

    def kv_usage(self) -> float:
        return sum(s.busy for s in self.slots) / len(self.slots)

    def cached_prefix_blocks(self, hashes: tuple[int, ...]) -> int:
        return max((common_prefix(s.chain, hashes) for s in self.slots), default=0)

    def _pick(self, chain: tuple[int, ...]) -> _Slot | None:
        idle = [s for s in self.slots if not s.busy]
        if not idle:
            return None
        best, best_sim = None, 0.0
        for s in idle:
            sim = common_prefix(s.chain, chain) / len(chain) if chain else 0.0
            if sim > best_sim and sim > SLOT_SIMILARITY:
                best, best_sim = s, sim
        return best or min(idle, key=lambda s: s.last_used)

    def _admit(self, req: EngineRequest) -> bool:
        bs = self.cfg.block_size
        chain = req.hashes[:self.slot_blocks]
        slot = self._pick(chain)
        if slot is None:
            return False
        hit = common_prefix(slot.chain, chain)
        if hit * bs >= req.prompt_tokens:  # one token must be computed to produce logits
            hit = max(0, -(-req.prompt_tokens // bs) - 1)
        if len(slot.chain) > hit:
            self.evictions += len(slot.chain) - hit
        slot.chain, slot.busy = chain, True
        self._slot_of[id(req)] = slot
        req.cached_tokens = req.computed = hit * bs
        self.prefix_queries += req.prompt_tokens
        self.prefix_hits += req.cached_tokens
        return True

    def _store_prefix(self, req: EngineRequest) -> None:
        pass  # the slot took the prompt's chain at admission

    def _release(self, req: EngineRequest, end: float) -> None:
        slot = self._slot_of.pop(id(req))
        slot.busy, slot.last_used = False, end


def make_engine(config: EngineConfig) -> Engine:
    """A paged engine (vLLM-like), or a slot engine (llama.cpp-like) when ``config.slots``."""
    return SlotEngine(config) if config.slots else Engine(config)
