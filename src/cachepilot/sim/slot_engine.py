"""A slot engine, modelled on llama-server: one prompt's KV per slot, plus the host-memory
prompt cache, no shared block cache.

Same interface and timing as :class:`~cachepilot.sim.engine.Engine` (one batch per step:
a token per decoding sequence, the rest of the token budget to prefill chunks, oldest
first), different memory (llama.cpp's tools/server; the rules are
:class:`cachepilot.core.slot_memory.SlotMemory`, the same model the gateway's directory
runs):

- ``slots`` slots, each with ``num_blocks // slots`` blocks of context; a request runs in
  one slot, so at most ``slots`` run at once and the rest wait (llama-server defers them).
- A waiting request takes the idle slot whose prompt shares the longest common prefix with
  it, if that is more than 10 % of its prompt (``--slot-prompt-similarity``), else the least
  recently used idle slot. With a prompt cache (``prompt_cache`` prompts: ``--cache-ram``)
  the prompt leaving the slot is saved there and the best cached match is restored into it.
  The common prefix is reused, at block granularity here (llama.cpp reuses tokens; the
  directory sees blocks).
- No KV gauge (llama.cpp exports none); prefix queries and hits count prompt tokens, as its
  ``prompt_tokens_total`` / ``prompt_tokens_cached_total``.

With ``sliding_window`` (Gemma 3), a match is reused only up to a context checkpoint, as
measured on llama-server (docs/real-model.md). Not modelled: generated tokens in a slot's
prefix.
"""

from __future__ import annotations

from cachepilot.core.slot_memory import SlotConfig, SlotMemory
from cachepilot.sim.engine import Engine, EngineConfig, EngineRequest


class SlotEngine(Engine):
    def __init__(self, config: EngineConfig) -> None:
        if config.slots < 1:
            raise ValueError("a slot engine needs slots >= 1")
        super().__init__(config)
        self.slot_blocks = max(1, config.num_blocks // config.slots)
        bs, batch = config.block_size, config.max_batched_tokens // config.block_size
        swa = config.sliding_window // bs
        self.memory = SlotMemory(SlotConfig(
            slots=config.slots, slot_blocks=self.slot_blocks, entries=config.prompt_cache,
            min_reuse=swa, batch=batch if swa else 0,
            checkpoint_offsets=(batch, 0) if swa else ()))
        self.busy = [False] * config.slots
        self._slot_of: dict[int, int] = {}  # id(request) → its slot

    def submit(self, req: EngineRequest) -> None:
        need = -(-(req.prompt_tokens + req.max_tokens) // self.cfg.block_size)
        if need > self.slot_blocks:
            raise ValueError(f"request needs {need} KV blocks; a slot has {self.slot_blocks}")
        self.waiting.append(req)

    def kv_usage(self) -> float:
        return sum(self.busy) / len(self.busy)

    def cached_prefix_blocks(self, hashes: tuple[int, ...]) -> int:
        """What a request with these blocks would reuse if an idle slot took it now."""
        idle = [not b for b in self.busy]
        return self.memory.reuse(hashes, idle) if any(idle) else 0

    def _admit(self, req: EngineRequest) -> bool:
        if all(self.busy):
            return False
        bs = self.cfg.block_size
        placed = self.memory.place(req.hashes, [not b for b in self.busy])
        hit = placed.reused
        if hit * bs >= req.prompt_tokens:  # one token must be computed to produce logits
            hit = max(0, -(-req.prompt_tokens // bs) - 1)
        # Blocks the worker no longer holds (other copies in the cache aside).
        self.evictions += len({h for c in placed.removed for h in c}
                              - {h for c in placed.added for h in c})
        self.busy[placed.slot] = True
        self._slot_of[id(req)] = placed.slot
        req.cached_tokens = req.computed = hit * bs
        self.prefix_queries += req.prompt_tokens
        self.prefix_hits += req.cached_tokens
        return True

    def _store_prefix(self, req: EngineRequest) -> None:
        pass  # the slot took the prompt's chain at admission

    def _release(self, req: EngineRequest, end: float) -> None:
        slot = self._slot_of.pop(id(req))
        self.busy[slot] = False
        self.memory.release(slot)


def make_engine(config: EngineConfig) -> Engine:
    """A paged engine (vLLM-like), or a slot engine (llama.cpp-like) when ``config.slots``."""
    return SlotEngine(config) if config.slots else Engine(config)
