"""The prefix directory's slot engines (llama.cpp): what a worker put in slot mode
(:meth:`cachepilot.core.directory.PrefixDirectory.set_slots`) holds, and what a placement
there would make homeless.

Such a worker holds one chain per slot and, unless the engine runs without one, the prompts
its host-memory prompt cache saved, both kept by the engine's own rules
(:class:`cachepilot.core.slot_memory.SlotMemory`); a block is in the directory's index while
any of those prompts holds it (``WorkerBlocks.refs`` counts them). What a placement would
make homeless is priced by how often recent prompts reused it
(:class:`cachepilot.core.popularity.BlockPopularity`), and is nothing while the cache has
room.
"""

from __future__ import annotations

from collections.abc import Sequence

from cachepilot.core.popularity import BlockPopularity
from cachepilot.core.slot_memory import SlotConfig, SlotMemory
from cachepilot.core.worker_blocks import WorkerBlocks, drop_bit


def slot_config(slots: int, slot_blocks: int, *, entries: int, max_blocks: int | None,
                min_reuse: int, batch: int) -> SlotConfig:
    """The engine model for :meth:`~cachepilot.core.directory.PrefixDirectory.set_slots`'s
    arguments (sizes clamped to at least one slot of one block)."""
    return SlotConfig(slots=max(1, slots), slot_blocks=max(1, slot_blocks),
                      entries=max(0, entries), max_blocks=max_blocks, min_reuse=min_reuse,
                      batch=batch if min_reuse else 0,
                      checkpoint_offsets=(batch, 0) if min_reuse else ())


class SlotPlacements:
    """The directory's slot-engine bookkeeping over its routing-learned index ``masks``
    (hash → worker bitmask, shared with the directory): each slot worker's prompts, how
    often placed prompts held each block, and the eviction values a replay restores (a
    rebuilt directory has no slots)."""

    def __init__(self, masks: dict[int, int]) -> None:
        self._masks = masks
        self.popularity = BlockPopularity()
        self.total = 0  # about how many prompts the slot workers keep, all together
        self.restored: dict[str, float] = {}

    def configure(self, wb: WorkerBlocks, cfg: SlotConfig) -> None:
        """Put ``wb`` in slot mode under ``cfg``, keeping what it held as far as it fits:
        its most recent chains, one per slot, and its cache."""
        if wb.memory is not None and wb.memory.cfg == cfg:
            return
        old = wb.memory
        self._set_total(self.total + _prompts_held(cfg)
                        - (0 if old is None else _prompts_held(old.cfg)))
        if old is not None:
            order = sorted(range(len(old.slots)), key=lambda i: old.last_used[i])
            kept = [old.slots[i] for i in order if old.slots[i]][-cfg.slots:]
            cached = list(old.cache)
        else:  # from LRU mode: the most recent blocks, one chain
            kept = [tuple(wb.lru.most_recent(cfg.slot_blocks))] if wb.lru else []
            cached = []
        for h in wb.held():
            drop_bit(self._masks, h, wb.bit)
        wb.lru.clear()
        wb.refs.clear()
        wb.last_chain = None
        wb.capacity = (cfg.slots + cfg.entries) * cfg.slot_blocks
        memory = wb.memory = SlotMemory(cfg)
        for i, chain in enumerate(kept):
            memory.slots[i] = tuple(chain[:cfg.slot_blocks])
            memory.release(i)
        if cfg.cached:
            memory.cache = [tuple(c[:cfg.slot_blocks]) for c in cached if c]
            if cfg.entries:
                memory.cache = memory.cache[-cfg.entries:]
        for chain in memory.chains():
            self.hold(wb, chain)

    def forget(self, wb: WorkerBlocks) -> None:
        """``wb`` left the directory: its prompts no longer count."""
        if wb.memory is not None:
            self._set_total(self.total - _prompts_held(wb.memory.cfg))

    def _set_total(self, n: int) -> None:
        # A block's reuse is judged over about as many placements as the pool has slots (a
        # prompt not overwritten now survives roughly that long), against a count that
        # remembers a few times longer.
        self.total = n
        self.popularity.half_life = max(16.0, 4.0 * n)

    def insert(self, wb: WorkerBlocks, hashes: Sequence[int], turn: int = 0) -> None:
        """The prompt is launched as llama-server would (:class:`SlotMemory`; ``turn``: the
        block where a chat request's last message starts, 0 if none). Which slots are busy
        is unknown here, so all count as idle, and it ends most recently used."""
        assert wb.memory is not None
        self.popularity.note(hashes[:wb.memory.cfg.slot_blocks])
        placed = wb.memory.place(hashes, turn=turn)
        wb.memory.release(placed.slot)
        for chain in placed.added:  # first, so blocks both share are never dropped
            self.hold(wb, chain)
        for chain in placed.removed:
            self.unhold(wb, chain)

    def hold(self, wb: WorkerBlocks, chain: Sequence[int]) -> None:
        masks, bit, refs = self._masks, wb.bit, wb.refs
        for h in chain:
            if h in refs:
                refs[h] += 1
            else:
                refs[h] = 1
                masks[h] = masks.get(h, 0) | bit

    def unhold(self, wb: WorkerBlocks, chain: Sequence[int]) -> None:
        refs = wb.refs
        for h in chain:
            n = refs[h] - 1
            if n:
                refs[h] = n
            else:
                del refs[h]
                drop_bit(self._masks, h, wb.bit)
                wb.evictions += 1

    def eviction_blocks(self, worker: str, wb: WorkerBlocks | None,
                        hashes: Sequence[int]) -> float:
        """See :meth:`cachepilot.core.directory.PrefixDirectory.eviction_blocks` (``wb``:
        ``worker``'s blocks, None if unknown)."""
        if worker in self.restored:
            return self.restored[worker]
        if wb is None or wb.memory is None:
            return 0.0
        placed = wb.memory.plan(hashes)
        delta: dict[int, int] = {}
        for chain in placed.removed:
            for h in chain:
                delta[h] = delta.get(h, 0) - 1
        for chain in placed.added:
            for h in chain:
                if h in delta:
                    delta[h] += 1
        others, masks, pop, refs = ~wb.bit, self._masks, self.popularity, wb.refs
        horizon = float(self.total)
        return sum(pop.reuse_probability(h, horizon) for h, d in delta.items()
                   if d < 0 and refs.get(h, 0) + d <= 0 and not masks.get(h, 0) & others)


def _prompts_held(cfg: SlotConfig) -> int:
    """About how many prompts a slot engine keeps: its slots and its cache's entries."""
    return cfg.slots + cfg.entries
