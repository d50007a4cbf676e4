"""What the prefix directory (:mod:`cachepilot.core.directory`) keeps about one worker: its
routing-learned blocks (an LRU of chains, or a slot engine's prompts), its event set and
pending blocks in exact mode, and the mode a match reads it in (:data:`MODES`).

The directory's two indexes are hash → worker-bitmask maps (one bit per worker, ``bit``
here); :func:`drop_bit` clears one worker's bit in either.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from cachepilot.core.chain_lru import ChainLRU
from cachepilot.core.slot_memory import SlotMemory

Mode = Literal["exact", "degraded", "approximate"]
EXACT: Final = "exact"
DEGRADED: Final = "degraded"
APPROXIMATE: Final = "approximate"
MODES: tuple[Mode, ...] = (EXACT, DEGRADED, APPROXIMATE)


@dataclass(slots=True)
class WorkerBlocks:
    bit: int
    capacity: int
    lru: ChainLRU = field(default_factory=ChainLRU)  # the routing-learned set, in LRU order
    evictions: int = 0
    # Slot mode: the engine's slots and prompt cache, and how many of the prompts it holds
    # contain each block (``lru`` is then unused).
    memory: SlotMemory | None = None
    refs: dict[int, int] = field(default_factory=dict)
    # Exact mode: the blocks the engine's events say it holds, and which set a match reads.
    mode: Mode = APPROXIMATE
    events: set[int] = field(default_factory=set)
    # Blocks routed here whose BlockStored has not come yet (the prefill is still running):
    # hash → the generation it was routed in; aged out by :meth:`PrefixDirectory.age_pending`.
    pending: OrderedDict[int, int] = field(default_factory=OrderedDict)
    generation: int = 0
    # The routing-learned set is prefix-closed: every insert adds a whole chain, and the
    # LRU evicts a chain's blocks leaf first (a parent is touched after its children, so it
    # is never older), so holding a block means holding its chain up to it. An engine's
    # removal can punch a hole; from then on matches scan (until the set is emptied).
    closed: bool = True
    # The chain the last insert touched, while nothing else has changed ``lru`` since: the
    # same chain again (one prompt sent over and over) needs no move at all.
    last_chain: Sequence[int] | None = None
    # Engine restarts (see PrefixDirectory.restarted): how many the scrape found (the event
    # stream watches it), and when the batch 0 the event set starts from was stamped (the
    # engine's clock; None: the set does not start at a publisher's batch 0).
    epoch: int = 0
    events_since: float | None = None

    def held(self) -> Iterable[int]:
        return self.refs if self.memory is not None else self.lru.held()

    @property
    def slots(self) -> int:
        return 0 if self.memory is None else len(self.memory.slots)

    def forget_learned(self, masks: dict[int, int]) -> None:
        """Empty the routing-learned set (a slot engine's: its prompts), unindexing it from
        ``masks``."""
        for h in self.held():
            drop_bit(masks, h, self.bit)
        self.lru.clear()
        self.closed, self.last_chain = True, None
        if self.memory is not None:
            self.refs.clear()
            self.memory.clear()

    def stats(self) -> dict[str, int]:
        """Blocks held, capacity and evictions (a slot engine's slots and cache too)."""
        out = {"blocks": len(self.refs) if self.memory is not None else len(self.lru),
               "capacity": self.capacity, "evictions": self.evictions}
        if self.memory is not None:
            out |= {"slots": len(self.memory.slots), "cached_prompts": len(self.memory.cache),
                    "cache_entries": self.memory.cfg.entries}
        return out

    def mode_stats(self) -> dict[str, int | str]:
        """The mode, and how many blocks the events say are held or pending."""
        return {"mode": self.mode, "event_blocks": len(self.events),
                "pending_blocks": len(self.pending.keys() - self.events)}


def drop_bit(masks: dict[int, int], h: int, bit: int) -> None:
    """Clear one worker's bit of block ``h`` in a hash → worker-bitmask index, dropping the
    entry once no worker holds the block."""
    mask = masks.get(h, 0) & ~bit
    if mask:
        masks[h] = mask
    else:
        masks.pop(h, None)
