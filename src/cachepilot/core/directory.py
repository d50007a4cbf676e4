"""Which worker probably holds which KV blocks: an approximate, bounded prefix index.

Entries are inserted when a request is routed (the worker will compute and cache its blocks)
and evicted LRU per worker at the worker's capacity in blocks, as a paged engine (vLLM, SGLang)
would. Slot engines (llama.cpp) keep whole prompts instead, one per slot: a worker put in slot
mode (:meth:`PrefixDirectory.set_slots`) holds one chain per slot, replaced the way
llama-server picks a slot. A single hash → worker-bitmask map makes a longest-prefix match one
dict lookup and one AND per matched block, whatever the number of workers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class _WorkerBlocks:
    bit: int
    capacity: int
    lru: OrderedDict[int, None] = field(default_factory=OrderedDict)  # oldest first
    evictions: int = 0
    # Slot mode: each slot's prompt chain, least recently used slot first, and how many
    # slots' chains hold each block (``lru`` is then unused).
    slots: list[tuple[int, ...]] | None = None
    slot_blocks: int = 0
    refs: dict[int, int] = field(default_factory=dict)

    def held(self) -> Iterable[int]:
        return self.refs if self.slots is not None else self.lru


class PrefixDirectory:
    """Approximate per-worker prefix cache index with LRU eviction."""

    def __init__(self, default_capacity: int = 4096) -> None:
        self.default_capacity = default_capacity
        self._workers: dict[str, _WorkerBlocks] = {}
        self._masks: dict[int, int] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0

    # -- membership -------------------------------------------------------------------------
    def add_worker(self, worker: str, capacity: int | None = None) -> None:
        if worker in self._workers:
            if capacity is not None:
                self.set_capacity(worker, capacity)
            return
        bit = self._free_bits.pop() if self._free_bits else self._take_bit()
        self._workers[worker] = _WorkerBlocks(bit=1 << bit,
                                              capacity=capacity or self.default_capacity)

    def _take_bit(self) -> int:
        bit = self._next_bit
        self._next_bit += 1
        return bit

    def remove_worker(self, worker: str) -> None:
        """Forget a worker and every block it held."""
        wb = self._workers.pop(worker, None)
        if wb is None:
            return
        for h in wb.held():
            self._clear(h, wb.bit)
        self._free_bits.append(wb.bit.bit_length() - 1)

    def set_capacity(self, worker: str, capacity: int) -> None:
        wb = self._workers[worker]
        wb.capacity = max(1, capacity)
        if wb.slots is None:
            self._evict(wb)

    def set_slots(self, worker: str, slots: int, slot_blocks: int) -> None:
        """Model ``worker`` as a slot engine: ``slots`` prompts of at most ``slot_blocks``
        blocks each (llama-server's ``total_slots`` and per-slot context). What it held
        before is kept as far as it fits: its most recent chains, one per slot."""
        wb = self._workers.get(worker)
        if wb is None or (wb.slots is not None and len(wb.slots) == slots
                          and wb.slot_blocks == slot_blocks):
            return
        slots, slot_blocks = max(1, slots), max(1, slot_blocks)
        kept = list(wb.slots or [])[-slots:]
        if wb.slots is None and wb.lru:  # from LRU mode: the most recent blocks, one chain
            kept = [tuple(reversed(list(wb.lru)))[:slot_blocks]]
        for h in wb.held():
            self._clear(h, wb.bit)
        wb.lru.clear()
        wb.refs.clear()
        wb.slots, wb.slot_blocks, wb.capacity = [], slot_blocks, slots * slot_blocks
        for chain in [()] * (slots - len(kept)) + kept:
            self._fill_slot(wb, tuple(chain[:slot_blocks]))

    def workers(self) -> list[str]:
        return list(self._workers)

    def __contains__(self, worker: str) -> bool:
        return worker in self._workers

    # -- data ---------------------------------------------------------------------------------
    def insert(self, worker: str, hashes: Sequence[int]) -> None:
        """Record that ``worker`` now holds these blocks (a prompt's chain, root first).

        Blocks are touched leaf-first so the root ends most recently used: a shared prefix
        outlives the unique tails hanging off it, as in vLLM's free-block queue.
        """
        wb = self._workers.get(worker)
        if wb is None:
            return
        if wb.slots is not None:
            self._insert_slot(wb, hashes)
            return
        lru, masks, bit = wb.lru, self._masks, wb.bit
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                masks[h] = masks.get(h, 0) | bit
        self._evict(wb)

    def _evict(self, wb: _WorkerBlocks) -> None:
        lru, masks, keep = wb.lru, self._masks, ~wb.bit
        excess = len(lru) - wb.capacity
        for _ in range(excess):  # the hot loop of a full directory: _clear inlined
            h, _ = lru.popitem(last=False)
            mask = masks[h] & keep
            if mask:
                masks[h] = mask
            else:
                del masks[h]
        if excess > 0:
            wb.evictions += excess

    # The similarity a slot's prompt needs to be reused (llama-server's
    # --slot-prompt-similarity default): below it, the least recently used slot is taken.
    SLOT_SIMILARITY = 0.1

    def _insert_slot(self, wb: _WorkerBlocks, hashes: Sequence[int]) -> None:
        """The prompt replaces one slot's, as llama-server's ``get_available_slot`` picks
        it (tools/server/server.cpp): the slot sharing the longest common prefix, as a
        fraction of the new prompt above ``SLOT_SIMILARITY``, else the least recently used.
        Which slots are busy is unknown here, so all count as idle."""
        assert wb.slots is not None
        chain = tuple(hashes[:wb.slot_blocks])
        best, best_sim = 0, 0.0  # index 0: the least recently used slot
        for i, held in enumerate(wb.slots):
            common = 0
            for a, b in zip(held, chain, strict=False):
                if a != b:
                    break
                common += 1
            sim = common / len(chain) if chain else 0.0
            if sim > best_sim and sim > self.SLOT_SIMILARITY:
                best, best_sim = i, sim
        old = wb.slots.pop(best)
        self._fill_slot(wb, chain)  # first, so blocks both share are never dropped
        for h in old:
            n = wb.refs[h] - 1
            if n:
                wb.refs[h] = n
            else:
                del wb.refs[h]
                self._clear(h, wb.bit)
                wb.evictions += 1

    def _fill_slot(self, wb: _WorkerBlocks, chain: tuple[int, ...]) -> None:
        """Append ``chain`` as the most recently used slot."""
        assert wb.slots is not None
        wb.slots.append(chain)
        masks, bit, refs = self._masks, wb.bit, wb.refs
        for h in chain:
            if h in refs:
                refs[h] += 1
            else:
                refs[h] = 1
                masks[h] = masks.get(h, 0) | bit

    def _clear(self, h: int, bit: int) -> None:
        mask = self._masks.get(h, 0) & ~bit
        if mask:
            self._masks[h] = mask
        else:
            self._masks.pop(h, None)

    def match(self, hashes: Sequence[int], workers: Iterable[str]) -> dict[str, int]:
        """Longest cached prefix, in blocks, for each of ``workers``."""
        wanted = {w: self._workers[w].bit for w in workers if w in self._workers}
        result = dict.fromkeys(wanted, 0)
        active = 0
        for bit in wanted.values():
            active |= bit
        masks = self._masks
        depth = 0
        for h in hashes:
            still = active & masks.get(h, 0)
            if still != active:
                dropped = active & ~still
                for w, bit in wanted.items():
                    if dropped & bit:
                        result[w] = depth
                active = still
                if not active:
                    return result
            depth += 1
        for w, bit in wanted.items():
            if active & bit:
                result[w] = depth
        return result

    def stats(self) -> dict[str, dict[str, int]]:
        return {w: {"blocks": len(wb.refs) if wb.slots is not None else len(wb.lru),
                    "capacity": wb.capacity, "evictions": wb.evictions}
                for w, wb in self._workers.items()}

    def distinct_blocks(self) -> int:
        return len(self._masks)
