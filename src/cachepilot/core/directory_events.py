"""The prefix directory's exact mode (issue 13): the blocks an engine's KV-cache events say
a worker holds (vLLM's BlockStored / BlockRemoved / AllBlocksCleared), applied to the
directory's *event set*, a second hash → worker-bitmask map beside the routing-learned one.

Blocks routed to a worker whose prefill has not been announced yet are *pending*: in the
event map too (a second request for a prefix still being computed is a hit once the engine
schedules it) until the engine names them, or until they age out a few generations later
(:meth:`EventSets.age_pending`). The modes, and which set a match reads in each, are in
:mod:`cachepilot.core.directory`'s docstring; this module only keeps the sets.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from cachepilot.core.worker_blocks import WorkerBlocks, drop_bit


class EventSets:
    """Every worker's event set and pending blocks, indexed in ``masks`` (hash → the
    workers whose events, or pending routes, say they hold it); ``learned`` is the
    directory's routing-learned index, which an engine's removal prunes too."""

    def __init__(self, masks: dict[int, int], learned: dict[int, int]) -> None:
        self.masks = masks
        self._learned = learned

    def stored(self, wb: WorkerBlocks, hashes: Iterable[int]) -> None:
        """The engine stored these blocks (a BlockStored event's ``block_hashes``)."""
        events, masks, bit, pending = wb.events, self.masks, wb.bit, wb.pending
        for h in hashes:
            if h not in events:
                events.add(h)
                masks[h] = masks.get(h, 0) | bit
                pending.pop(h, None)  # confirmed

    def removed(self, wb: WorkerBlocks, hashes: Iterable[int]) -> None:
        """The engine evicted these blocks: gone from the event set and, since the engine
        says so, from the routing-learned set too. Except blocks routed here in the current
        generation by a request not prefilled yet (:meth:`prefilled`): vLLM announces a
        step's evictions after the step, so the removal is of the copy before that request,
        which computes the block again (it stays pending)."""
        events, bit = wb.events, wb.bit
        for h in hashes:
            if wb.pending.get(h) == wb.generation:
                events.discard(h)
                continue
            was_pending = wb.pending.pop(h, None) is not None
            if h in events:
                events.discard(h)
                drop_bit(self.masks, h, bit)
            elif was_pending:  # routed, never announced, now evicted: not held either way
                drop_bit(self.masks, h, bit)
            if wb.memory is None and wb.lru.discard(h):
                drop_bit(self._learned, h, bit)
                wb.last_chain = None
                wb.closed = False  # its descendants may still be held

    def prefilled(self, wb: WorkerBlocks, hashes: Iterable[int]) -> None:
        """The request that routed these blocks here has been prefilled (its first token,
        or its end): whatever it stored is announced by now (vLLM publishes a step's events
        before its output), so its blocks the events name stop being pending, and a later
        removal of one is a real eviction, believed at once (:meth:`removed` keeps only
        blocks a request still on its way will compute again). Blocks not announced stay
        pending until they are, or age out."""
        if not wb.pending:
            return
        events, pending = wb.events, wb.pending
        for h in hashes:
            if h in events:
                pending.pop(h, None)

    def add_pending(self, wb: WorkerBlocks, hashes: Sequence[int]) -> None:
        """These blocks were just routed to ``wb``: pending in the current generation."""
        masks, bit, pending, gen = self.masks, wb.bit, wb.pending, wb.generation
        for h in hashes:  # announced blocks too: a late removal must not drop them (removed)
            if h in pending:
                pending.move_to_end(h)
            else:
                masks[h] = masks.get(h, 0) | bit
            pending[h] = gen

    def age_pending(self, wb: WorkerBlocks, keep: int) -> None:
        """Start a new generation; drop pending blocks routed ``keep`` or more generations
        ago that the engine never announced."""
        wb.generation += 1
        oldest = wb.generation - keep
        pending = wb.pending
        while pending:
            h, gen = next(iter(pending.items()))
            if gen > oldest:
                break
            del pending[h]
            if h not in wb.events:
                drop_bit(self.masks, h, wb.bit)

    def drop(self, wb: WorkerBlocks) -> None:
        """Forget ``wb``'s event set and pending blocks."""
        for h in wb.events:
            drop_bit(self.masks, h, wb.bit)
        for h in wb.pending:
            if h not in wb.events:
                drop_bit(self.masks, h, wb.bit)
        wb.events.clear()
        wb.pending.clear()
