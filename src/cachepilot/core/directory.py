"""Which worker probably holds which KV blocks: an approximate, bounded prefix index.

Entries are inserted when a request is routed (the worker will compute and cache its blocks)
and evicted LRU per worker at the worker's capacity in blocks, as a paged engine (vLLM, SGLang)
would. Slot engines (llama.cpp) keep whole prompts instead: a worker put in slot mode
(:meth:`PrefixDirectory.set_slots`) holds one chain per slot and, unless the engine runs
without one, the prompts its host-memory prompt cache saved, both kept by the engine's own
rules (:class:`cachepilot.core.slot_memory.SlotMemory`); what a placement there would make
homeless is priced by how often recent prompts reused it
(:meth:`PrefixDirectory.eviction_blocks`), and is nothing while the cache has room. A single hash →
worker-bitmask map makes a longest-prefix match one dict lookup and one AND per matched
block, whatever the number of workers.

Exact mode (issue 13): a worker whose engine publishes KV-cache events (vLLM's BlockStored /
BlockRemoved / AllBlocksCleared) also has an *event set*, the blocks the engine said it holds,
in a second hash → bitmask map. Each worker has a mode (:data:`MODES`) that says which set a
match reads:

- ``exact``: the event history is complete (from the engine's first event, or from an
  AllBlocksCleared), so the event set is the engine's truth: match on it, plus the blocks
  of requests routed there whose prefill has not been announced yet (*pending*, aged out
  after a few generations: without them a second request for a prefix still being
  computed would be predicted a miss, and the engine gives it a hit once it is scheduled).
- ``degraded``: events flow but the history has a hole (a late join past the publisher's
  replay buffer, a gap replay could not fill, a replay still in flight): blocks stored since
  are certain, older ones unknown, so match on the event set ∪ the routing-learned set.
- ``approximate``: no usable event stream (none configured, or the publisher stopped
  answering): match on the routing-learned set alone; a stale event set is never trusted.

The routing-learned (LRU) set is kept in every mode, so a fallback starts warm; a removal
event prunes it too (the engine said that block is gone, whatever routing guessed).
The fingerprints must be the engine's own block hashes for events to mean anything:
:func:`cachepilot.core.fingerprint.vllm_block_hashes`.

:class:`PrefixDirectory` is the facade over its parts: what it keeps per worker
(:mod:`cachepilot.core.worker_blocks`, with the modes), the lookup
(:mod:`cachepilot.core.directory_match`), slot engines
(:mod:`cachepilot.core.directory_slots`) and the event sets
(:mod:`cachepilot.core.directory_events`). The paged engines' insert and eviction, the hot
path, stay here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from cachepilot.core.directory_events import EventSets
from cachepilot.core.directory_match import match_blocks
from cachepilot.core.directory_slots import SlotPlacements, slot_config
from cachepilot.core.popularity import BlockPopularity
from cachepilot.core.slot_memory import common_prefix as common_prefix  # re-exported
from cachepilot.core.worker_blocks import APPROXIMATE as APPROXIMATE  # re-exported
from cachepilot.core.worker_blocks import DEGRADED as DEGRADED  # re-exported
from cachepilot.core.worker_blocks import EXACT as EXACT  # re-exported
from cachepilot.core.worker_blocks import MODES as MODES  # re-exported
from cachepilot.core.worker_blocks import Mode as Mode  # re-exported
from cachepilot.core.worker_blocks import WorkerBlocks, drop_bit


class PrefixDirectory:
    """Approximate per-worker prefix cache index with LRU eviction."""

    def __init__(self, default_capacity: int = 4096) -> None:
        self.default_capacity = default_capacity
        self._workers: dict[str, WorkerBlocks] = {}
        self._masks: dict[int, int] = {}  # hash → workers whose routing-learned set has it
        self._event_masks: dict[int, int] = {}  # hash → workers whose events say they hold it
        self._free_bits: list[int] = []
        self._next_bit = 0
        self._slots = SlotPlacements(self._masks)
        self._events = EventSets(self._event_masks, self._masks)

    @property
    def popularity(self) -> BlockPopularity:
        """Slot engines only: how often placed prompts held each block."""
        return self._slots.popularity

    # -- membership -------------------------------------------------------------------------
    def add_worker(self, worker: str, capacity: int | None = None) -> None:
        if worker in self._workers:
            if capacity is not None:
                self.set_capacity(worker, capacity)
            return
        bit = self._free_bits.pop() if self._free_bits else self._take_bit()
        self._workers[worker] = WorkerBlocks(bit=1 << bit,
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
            drop_bit(self._masks, h, wb.bit)
        self._events.drop(wb)
        self._free_bits.append(wb.bit.bit_length() - 1)
        self._slots.forget(wb)

    def set_capacity(self, worker: str, capacity: int) -> None:
        wb = self._workers[worker]
        wb.capacity = max(1, capacity)
        if wb.memory is None:
            self._evict(wb)

    def set_slots(self, worker: str, slots: int, slot_blocks: int, *, entries: int = 0,
                  max_blocks: int | None = None, min_reuse: int = 0, batch: int = 0) -> None:
        """Model ``worker`` as a slot engine: ``slots`` prompts of at most ``slot_blocks``
        blocks each (llama-server's ``total_slots`` and per-slot context), and a prompt
        cache of ``entries`` prompts (``max_blocks``: its token limit, in blocks, with no
        byte limit; neither: ``--cache-ram 0``). ``min_reuse`` and ``batch`` (blocks): a
        sliding-window model's window and the engine's ``-ub``, where its context
        checkpoints fall (:class:`~cachepilot.core.slot_memory.SlotConfig`). What it held
        before is kept as far as it fits: its most recent chains, one per slot, and its
        cache."""
        wb = self._workers.get(worker)
        if wb is None:
            return
        self._slots.configure(wb, slot_config(slots, slot_blocks, entries=entries,
                                              max_blocks=max_blocks, min_reuse=min_reuse,
                                              batch=batch))

    def workers(self) -> list[str]:
        return list(self._workers)

    def is_slot(self, worker: str) -> bool:
        """Whether ``worker`` is modelled as a slot engine (:meth:`set_slots`)."""
        wb = self._workers.get(worker)
        return wb is not None and wb.memory is not None

    def __contains__(self, worker: str) -> bool:
        return worker in self._workers

    # -- data ---------------------------------------------------------------------------------
    def insert(self, worker: str, hashes: Sequence[int], *, learned_only: bool = False,
               turn: int = 0) -> None:
        """Record that ``worker`` now holds these blocks (a prompt's chain, root first).

        Blocks are touched leaf-first so the root ends most recently used: a shared prefix
        outlives the unique tails hanging off it, as in vLLM's free-block queue.
        ``learned_only``: the hashes are not the engine's (a request whose prompt could not
        be reproduced exactly): never pending, since no event will ever name them.
        ``turn``: the full blocks before a chat request's last message (slot engines
        checkpoint there: :meth:`~cachepilot.core.slot_memory.SlotMemory.place`).
        """
        wb = self._workers.get(worker)
        if wb is None:
            return
        if wb.mode != APPROXIMATE and not learned_only:
            self._events.add_pending(wb, hashes)
        if wb.memory is not None:
            self._slots.insert(wb, hashes, turn)
            return
        lru, masks, bit = wb.lru, self._masks, wb.bit
        last = wb.last_chain
        if last is not None and len(last) == len(hashes) and last[-1:] == hashes[-1:] \
                and tuple(last) == tuple(hashes):
            return  # the same chain again, still the most recent: nothing moves
        for h in lru.touch(hashes):
            masks[h] = masks.get(h, 0) | bit
        self._evict(wb)
        wb.last_chain = hashes if len(hashes) <= wb.capacity else None

    def _evict(self, wb: WorkerBlocks) -> None:
        excess = len(wb.lru) - wb.capacity
        if excess <= 0:
            return
        wb.last_chain = None
        masks, keep = self._masks, ~wb.bit
        for h in wb.lru.evict(excess):  # the hot loop of a full directory: drop_bit inlined
            mask = masks[h] & keep
            if mask:
                masks[h] = mask
            else:
                del masks[h]
        wb.evictions += excess

    def eviction_blocks(self, worker: str, hashes: Sequence[int]) -> float:
        """What placing this prompt on slot engine ``worker`` would make homeless: the
        blocks that no prompt the worker still holds afterwards (slots and prompt cache)
        and no other worker has, each weighted by the chance another prompt soon needs it
        (:class:`~cachepilot.core.popularity.BlockPopularity`). 0 for a paged engine, whose
        LRU spreads evictions over many prompts' cold tails, and for a prompt cache with
        room (nothing is lost)."""
        return self._slots.eviction_blocks(worker, self._workers.get(worker), hashes)

    def restore_eviction(self, worker: str, blocks: float) -> None:
        """Replay: the recorded :meth:`eviction_blocks` of ``worker`` for the next decision."""
        self._slots.restored[worker] = blocks

    def match(self, hashes: Sequence[int], workers: Iterable[str], *,
              chained: bool = False, learned_only: bool = False) -> dict[str, int]:
        """Longest cached prefix, in blocks, for each of ``workers`` (each read through its
        mode: the event set, the routing-learned set, or both); for a slot engine, the
        prefix it would reuse. ``learned_only``: read the routing-learned set whatever the
        mode (hashes that are not the engine's). ``chained``: every list this directory was
        given and ``hashes`` are chained block hashes, which lets a prefix-closed set be
        bisected (:func:`~cachepilot.core.directory_match.match_blocks`)."""
        result = match_blocks(hashes, self._workers, workers, chained, learned_only,
                              self._masks, self._event_masks)
        for w in result:  # a slot engine's prompts are all in the index; it restores one
            memory = self._workers[w].memory
            if memory is not None and result[w]:
                result[w] = memory.reuse(hashes)
        return result

    # -- engine events (exact mode) ------------------------------------------------------------
    def mode(self, worker: str) -> Mode | None:
        wb = self._workers.get(worker)
        return wb.mode if wb is not None else None

    def set_mode(self, worker: str, mode: Mode) -> None:
        """Say which set ``worker``'s matches read. Falling back to ``approximate`` drops the
        event set: once the stream is lost it can only go stale, and a later stream starts
        from what it then says (``degraded`` until its history is complete again)."""
        if mode not in MODES:
            raise ValueError(f"unknown directory mode {mode!r}")
        wb = self._workers.get(worker)
        if wb is None:
            return
        if mode == APPROXIMATE:
            self._events.drop(wb)
        wb.mode = mode

    def stored(self, worker: str, hashes: Iterable[int]) -> None:
        """The engine stored these blocks (a BlockStored event's ``block_hashes``)."""
        wb = self._workers.get(worker)
        if wb is not None:
            self._events.stored(wb, hashes)

    def removed(self, worker: str, hashes: Iterable[int]) -> None:
        """The engine evicted these blocks: gone from the event set and the routing-learned
        set, except those a request not :meth:`prefilled` yet will compute again
        (:meth:`EventSets.removed <cachepilot.core.directory_events.EventSets.removed>`)."""
        wb = self._workers.get(worker)
        if wb is not None:
            self._events.removed(wb, hashes)

    def prefilled(self, worker: str, hashes: Iterable[int]) -> None:
        """The request that routed these blocks here has been prefilled (its first token,
        or its end): those the events name stop being pending (:meth:`EventSets.prefilled
        <cachepilot.core.directory_events.EventSets.prefilled>`)."""
        wb = self._workers.get(worker)
        if wb is not None:
            self._events.prefilled(wb, hashes)

    def cleared(self, worker: str) -> None:
        """The engine dropped every block (AllBlocksCleared, or a restart): both sets empty."""
        wb = self._workers.get(worker)
        if wb is None:
            return
        self._events.drop(wb)
        wb.forget_learned(self._masks)

    # -- engine restarts ------------------------------------------------------------------------
    def restarted(self, worker: str, process_start: float | None = None) -> None:
        """A scrape found a new engine process behind ``worker`` (started at
        ``process_start``, the engine's clock; None: counters went back): its cache is
        empty, so both sets are emptied and the restart count (:meth:`epoch`) goes up, which
        tells the event stream to expect the new publisher from its batch 0. Unless the
        event stream already follows the new process from its first batch (an event came
        before the scrape: its batch 0 is stamped after the process started, on the same
        clock): then the event set is the new engine's truth and only the routing-learned
        set, about the old process, is emptied."""
        wb = self._workers.get(worker)
        if wb is None:
            return
        fresh = (wb.events_since is not None and process_start is not None
                 and wb.events_since >= process_start)
        if fresh:
            wb.forget_learned(self._masks)
            return
        self.cleared(worker)
        wb.epoch += 1
        wb.events_since = None

    def events_fresh(self, worker: str, since: float | None) -> None:
        """The event set follows ``worker``'s publisher from its batch 0, stamped ``since``
        (the engine's clock; None: unknown)."""
        wb = self._workers.get(worker)
        if wb is not None:
            wb.events_since = since

    def epoch(self, worker: str) -> int:
        """How many engine restarts the scrape has found for ``worker``."""
        wb = self._workers.get(worker)
        return wb.epoch if wb is not None else 0

    def has_events(self, worker: str) -> bool:
        """Whether :meth:`stored_blocks` can say anything for ``worker``: it is read through
        the engine's events and some have arrived."""
        wb = self._workers.get(worker)
        return wb is not None and wb.mode != APPROXIMATE and bool(wb.events)

    def stored_blocks(self, worker: str, hashes: Iterable[int]) -> int:
        """How many of these blocks the engine's events say ``worker`` holds (0 without an
        event stream): how far a prefill routed there has got."""
        if not self.has_events(worker):
            return 0
        events = self._workers[worker].events
        return sum(1 for h in hashes if h in events)

    def event_blocks(self, worker: str) -> frozenset[int]:
        wb = self._workers.get(worker)
        return frozenset(wb.events) if wb is not None else frozenset()

    def age_pending(self, worker: str, keep: int = 2) -> None:
        """Start a new generation; pending blocks routed ``keep`` or more generations ago
        that the engine never announced are dropped (the adapter calls this on its clock,
        so a generation is a few seconds: longer than a prefill)."""
        wb = self._workers.get(worker)
        if wb is not None:
            self._events.age_pending(wb, keep)

    def stats(self) -> dict[str, dict[str, int]]:
        return {w: wb.stats() for w, wb in self._workers.items()}

    def modes(self) -> dict[str, dict[str, int | str]]:
        """Per worker: its mode and how many blocks its events say it holds."""
        return {w: wb.mode_stats() for w, wb in self._workers.items()}

    def distinct_blocks(self) -> int:
        return len(self._masks.keys() | self._event_masks.keys())
