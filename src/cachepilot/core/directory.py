"""Which worker probably holds which KV blocks: an approximate, bounded prefix index.

Entries are inserted when a request is routed (the worker will compute and cache its blocks)
and evicted LRU per worker at the worker's capacity in blocks, as the engine itself would.
A single hash → worker-bitmask map makes a longest-prefix match one dict lookup and one AND
per matched block, whatever the number of workers.
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
        for h in wb.lru:
            self._clear(h, wb.bit)
        self._free_bits.append(wb.bit.bit_length() - 1)

    def set_capacity(self, worker: str, capacity: int) -> None:
        wb = self._workers[worker]
        wb.capacity = max(1, capacity)
        self._evict(wb)

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
        return {w: {"blocks": len(wb.lru), "capacity": wb.capacity, "evictions": wb.evictions}
                for w, wb in self._workers.items()}

    def distinct_blocks(self) -> int:
        return len(self._masks)
