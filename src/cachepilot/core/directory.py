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
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from cachepilot.core.chain_lru import ChainLRU
from cachepilot.core.popularity import BlockPopularity
from cachepilot.core.slot_memory import SlotConfig, SlotMemory
from cachepilot.core.slot_memory import common_prefix as common_prefix  # re-exported

Mode = Literal["exact", "degraded", "approximate"]
EXACT: Final = "exact"
DEGRADED: Final = "degraded"
APPROXIMATE: Final = "approximate"
MODES: tuple[Mode, ...] = (EXACT, DEGRADED, APPROXIMATE)


@dataclass(slots=True)
class _WorkerBlocks:
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


class PrefixDirectory:
    """Approximate per-worker prefix cache index with LRU eviction."""

    def __init__(self, default_capacity: int = 4096) -> None:
        self.default_capacity = default_capacity
        self._workers: dict[str, _WorkerBlocks] = {}
        self._masks: dict[int, int] = {}
        self._event_masks: dict[int, int] = {}  # hash → workers whose events say they hold it
        self._free_bits: list[int] = []
        self._next_bit = 0
        # Slot engines only: how often placed prompts held each block, and the recorded
        # eviction values a replay restores (a rebuilt directory has no slots).
        self.popularity = BlockPopularity()
        self._slots_total = 0
        self._restored_evictions: dict[str, float] = {}

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
        self._drop_events(wb)
        self._free_bits.append(wb.bit.bit_length() - 1)
        if wb.memory is not None:
            self._set_slots_total(self._slots_total - _prompts_held(wb.memory.cfg))

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
        checkpoints fall (:class:`SlotConfig`). What it held before is kept as far as it fits: its
        most recent chains, one per slot, and its cache."""
        wb = self._workers.get(worker)
        if wb is None:
            return
        cfg = SlotConfig(slots=max(1, slots), slot_blocks=max(1, slot_blocks),
                         entries=max(0, entries), max_blocks=max_blocks, min_reuse=min_reuse,
                         batch=batch if min_reuse else 0,
                         checkpoint_offsets=(batch, 0) if min_reuse else ())
        if wb.memory is not None and wb.memory.cfg == cfg:
            return
        old = wb.memory
        self._set_slots_total(self._slots_total + _prompts_held(cfg)
                              - (0 if old is None else _prompts_held(old.cfg)))
        if old is not None:
            order = sorted(range(len(old.slots)), key=lambda i: old.last_used[i])
            kept = [old.slots[i] for i in order if old.slots[i]][-cfg.slots:]
            cached = list(old.cache)
        else:  # from LRU mode: the most recent blocks, one chain
            kept = [tuple(wb.lru.most_recent(cfg.slot_blocks))] if wb.lru else []
            cached = []
        for h in wb.held():
            self._clear(h, wb.bit)
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
            self._hold(wb, chain)

    def _set_slots_total(self, n: int) -> None:
        # A block's reuse is judged over about as many placements as the pool has slots (a
        # prompt not overwritten now survives roughly that long), against a count that
        # remembers a few times longer.
        self._slots_total = n
        self.popularity.half_life = max(16.0, 4.0 * n)

    def workers(self) -> list[str]:
        return list(self._workers)

    def __contains__(self, worker: str) -> bool:
        return worker in self._workers

    # -- data ---------------------------------------------------------------------------------
    def insert(self, worker: str, hashes: Sequence[int], *, learned_only: bool = False) -> None:
        """Record that ``worker`` now holds these blocks (a prompt's chain, root first).

        Blocks are touched leaf-first so the root ends most recently used: a shared prefix
        outlives the unique tails hanging off it, as in vLLM's free-block queue.
        ``learned_only``: the hashes are not the engine's (a request whose prompt could not
        be reproduced exactly): never pending, since no event will ever name them.
        """
        wb = self._workers.get(worker)
        if wb is None:
            return
        if wb.mode != APPROXIMATE and not learned_only:
            self._add_pending(wb, hashes)
        if wb.memory is not None:
            self._insert_slot(wb, hashes)
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

    def _evict(self, wb: _WorkerBlocks) -> None:
        excess = len(wb.lru) - wb.capacity
        if excess <= 0:
            return
        wb.last_chain = None
        masks, keep = self._masks, ~wb.bit
        for h in wb.lru.evict(excess):  # the hot loop of a full directory: _clear inlined
            mask = masks[h] & keep
            if mask:
                masks[h] = mask
            else:
                del masks[h]
        wb.evictions += excess

    def _insert_slot(self, wb: _WorkerBlocks, hashes: Sequence[int]) -> None:
        """The prompt is launched as llama-server would (:class:`SlotMemory`). Which slots
        are busy is unknown here, so all count as idle, and it ends most recently used."""
        assert wb.memory is not None
        self.popularity.note(hashes[:wb.memory.cfg.slot_blocks])
        placed = wb.memory.place(hashes)
        wb.memory.release(placed.slot)
        for chain in placed.added:  # first, so blocks both share are never dropped
            self._hold(wb, chain)
        for chain in placed.removed:
            self._unhold(wb, chain)

    def _hold(self, wb: _WorkerBlocks, chain: Sequence[int]) -> None:
        masks, bit, refs = self._masks, wb.bit, wb.refs
        for h in chain:
            if h in refs:
                refs[h] += 1
            else:
                refs[h] = 1
                masks[h] = masks.get(h, 0) | bit

    def _unhold(self, wb: _WorkerBlocks, chain: Sequence[int]) -> None:
        refs = wb.refs
        for h in chain:
            n = refs[h] - 1
            if n:
                refs[h] = n
            else:
                del refs[h]
                self._clear(h, wb.bit)
                wb.evictions += 1

    def eviction_blocks(self, worker: str, hashes: Sequence[int]) -> float:
        """What placing this prompt on slot engine ``worker`` would make homeless: the
        blocks that no prompt the worker still holds afterwards (slots and prompt cache)
        and no other worker has, each weighted by the chance another prompt soon needs it
        (:class:`BlockPopularity`). 0 for a paged engine, whose LRU spreads evictions over
        many prompts' cold tails, and for a prompt cache with room (nothing is lost)."""
        if worker in self._restored_evictions:
            return self._restored_evictions[worker]
        wb = self._workers.get(worker)
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
        horizon = float(self._slots_total)
        return sum(pop.reuse_probability(h, horizon) for h, d in delta.items()
                   if d < 0 and refs.get(h, 0) + d <= 0 and not masks.get(h, 0) & others)

    def restore_eviction(self, worker: str, blocks: float) -> None:
        """Replay: the recorded :meth:`eviction_blocks` of ``worker`` for the next decision."""
        self._restored_evictions[worker] = blocks

    def _clear(self, h: int, bit: int) -> None:
        _drop_bit(self._masks, h, bit)

    def match(self, hashes: Sequence[int], workers: Iterable[str], *,
              chained: bool = False, learned_only: bool = False) -> dict[str, int]:
        """Longest cached prefix, in blocks, for each of ``workers`` (each read through its
        mode: the event set, the routing-learned set, or both); for a slot engine, the
        prefix it would reuse. ``learned_only``: read the routing-learned set whatever the
        mode (hashes that are not the engine's).

        ``chained``: every list this directory was given and ``hashes`` are chained block
        hashes (a block's hash names its whole prefix, as fingerprints do), so a worker
        read through its routing-learned set alone, that set being *prefix-closed*
        (:attr:`_WorkerBlocks.closed`: holding a block means holding every block before it),
        is found by bisection, a few dozen lookups whatever the prompt's length
        (:func:`_closed_depths`). The others, and every worker without ``chained``, by a
        scan that stops where the last of them stops matching."""
        result = self._match_blocks(hashes, workers, chained, learned_only)
        for w in result:  # a slot engine's prompts are all in the index; it restores one
            memory = self._workers[w].memory
            if memory is not None and result[w]:
                result[w] = memory.reuse(hashes)
        return result

    def _match_blocks(self, hashes: Sequence[int], workers: Iterable[str], chained: bool,
                      learned_only: bool) -> dict[str, int]:
        wanted = {w: self._workers[w] for w in workers if w in self._workers}
        result = dict.fromkeys(wanted, 0)
        if not hashes:
            return result
        closed = learned = exact = 0  # bits read by bisection / the scan's two maps
        for wb in wanted.values():
            if chained and wb.closed and (wb.mode == APPROXIMATE or learned_only):
                closed |= wb.bit
                continue
            if wb.mode != EXACT or learned_only:
                learned |= wb.bit
            if wb.mode != APPROXIMATE and not learned_only:
                exact |= wb.bit
        found = (_closed_depths(hashes, closed, self._masks) if closed else []) + (
            self._scan(hashes, learned, exact) if learned | exact else [])
        for depth, bits in found:
            for w, wb in wanted.items():
                if bits & wb.bit:
                    result[w] = depth
        return result

    def _scan(self, hashes: Sequence[int], learned: int, exact: int) -> list[tuple[int, int]]:
        """Block by block: (depth, the bits that stop matching there), the bits that match
        every block last, at ``len(hashes)``."""
        active = learned | exact
        masks, event_masks = self._masks, self._event_masks
        out: list[tuple[int, int]] = []
        depth = 0
        for h in hashes:
            held = masks.get(h, 0) & learned
            if exact:
                held |= event_masks.get(h, 0) & exact
            still = active & held
            if still != active:
                out.append((depth, active & ~still))
                active = still
                if not active:
                    return out
            depth += 1
        out.append((depth, active))
        return out

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
            self._drop_events(wb)
        wb.mode = mode

    def stored(self, worker: str, hashes: Iterable[int]) -> None:
        """The engine stored these blocks (a BlockStored event's ``block_hashes``)."""
        wb = self._workers.get(worker)
        if wb is None:
            return
        events, masks, bit, pending = wb.events, self._event_masks, wb.bit, wb.pending
        for h in hashes:
            if h not in events:
                events.add(h)
                masks[h] = masks.get(h, 0) | bit
                pending.pop(h, None)  # confirmed

    def removed(self, worker: str, hashes: Iterable[int]) -> None:
        """The engine evicted these blocks: gone from the event set and, since the engine
        says so, from the routing-learned set too. Except blocks routed here in the current
        generation by a request not prefilled yet (:meth:`prefilled`): vLLM announces a
        step's evictions after the step, so the removal is of the copy before that request,
        which computes the block again (it stays pending)."""
        wb = self._workers.get(worker)
        if wb is None:
            return
        events, bit = wb.events, wb.bit
        for h in hashes:
            if wb.pending.get(h) == wb.generation:
                events.discard(h)
                continue
            was_pending = wb.pending.pop(h, None) is not None
            if h in events:
                events.discard(h)
                self._clear_event(h, bit)
            elif was_pending:  # routed, never announced, now evicted: not held either way
                self._clear_event(h, bit)
            if wb.memory is None and wb.lru.discard(h):
                self._clear(h, bit)
                wb.last_chain = None
                wb.closed = False  # its descendants may still be held

    def prefilled(self, worker: str, hashes: Iterable[int]) -> None:
        """The request that routed these blocks here has been prefilled (its first token,
        or its end): whatever it stored is announced by now (vLLM publishes a step's events
        before its output), so its blocks the events name stop being pending, and a later
        removal of one is a real eviction, believed at once (:meth:`removed` keeps only
        blocks a request still on its way will compute again). Blocks not announced stay
        pending until they are, or age out."""
        wb = self._workers.get(worker)
        if wb is None or not wb.pending:
            return
        events, pending = wb.events, wb.pending
        for h in hashes:
            if h in events:
                pending.pop(h, None)

    def cleared(self, worker: str) -> None:
        """The engine dropped every block (AllBlocksCleared, or a restart): both sets empty."""
        wb = self._workers.get(worker)
        if wb is None:
            return
        self._drop_events(wb)
        for h in wb.held():
            self._clear(h, wb.bit)
        wb.lru.clear()
        wb.closed, wb.last_chain = True, None
        if wb.memory is not None:
            wb.refs.clear()
            wb.memory.clear()

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
            for h in wb.held():
                self._clear(h, wb.bit)
            wb.lru.clear()
            wb.closed, wb.last_chain = True, None
            if wb.memory is not None:
                wb.refs.clear()
                wb.memory.clear()
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

    def stored_blocks(self, worker: str, hashes: Iterable[int]) -> int:
        """How many of these blocks the engine's events say ``worker`` holds (0 without an
        event stream): how far a prefill routed there has got."""
        wb = self._workers.get(worker)
        if wb is None or wb.mode == APPROXIMATE or not wb.events:
            return 0
        events = wb.events
        return sum(1 for h in hashes if h in events)

    def event_blocks(self, worker: str) -> frozenset[int]:
        wb = self._workers.get(worker)
        return frozenset(wb.events) if wb is not None else frozenset()

    def age_pending(self, worker: str, keep: int = 2) -> None:
        """Start a new generation; pending blocks routed ``keep`` or more generations ago
        that the engine never announced are dropped (the adapter calls this on its clock,
        so a generation is a few seconds: longer than a prefill)."""
        wb = self._workers.get(worker)
        if wb is None:
            return
        wb.generation += 1
        oldest = wb.generation - keep
        pending = wb.pending
        while pending:
            h, gen = next(iter(pending.items()))
            if gen > oldest:
                break
            del pending[h]
            if h not in wb.events:
                self._clear_event(h, wb.bit)

    def _add_pending(self, wb: _WorkerBlocks, hashes: Sequence[int]) -> None:
        masks, bit, pending, gen = self._event_masks, wb.bit, wb.pending, wb.generation
        for h in hashes:  # announced blocks too: a late removal must not drop them (removed)
            if h in pending:
                pending.move_to_end(h)
            else:
                masks[h] = masks.get(h, 0) | bit
            pending[h] = gen

    def _drop_events(self, wb: _WorkerBlocks) -> None:
        for h in wb.events:
            self._clear_event(h, wb.bit)
        for h in wb.pending:
            if h not in wb.events:
                self._clear_event(h, wb.bit)
        wb.events.clear()
        wb.pending.clear()

    def _clear_event(self, h: int, bit: int) -> None:
        _drop_bit(self._event_masks, h, bit)

    def stats(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for w, wb in self._workers.items():
            out[w] = {"blocks": len(wb.refs) if wb.memory is not None else len(wb.lru),
                      "capacity": wb.capacity, "evictions": wb.evictions}
            if wb.memory is not None:
                out[w] |= {"slots": len(wb.memory.slots), "cached_prompts": len(wb.memory.cache),
                           "cache_entries": wb.memory.cfg.entries}
        return out

    def modes(self) -> dict[str, dict[str, int | str]]:
        """Per worker: its mode and how many blocks its events say it holds."""
        return {w: {"mode": wb.mode, "event_blocks": len(wb.events),
                    "pending_blocks": len(wb.pending.keys() - wb.events)}
                for w, wb in self._workers.items()}

    def distinct_blocks(self) -> int:
        return len(self._masks.keys() | self._event_masks.keys())


def _prompts_held(cfg: SlotConfig) -> int:
    """About how many prompts a slot engine keeps: its slots and its cache's entries."""
    return cfg.slots + cfg.entries


def _closed_depths(hashes: Sequence[int], bits: int, masks: dict[int, int]
                   ) -> list[tuple[int, int]]:
    """(depth, workers) for workers of ``bits`` whose sets are prefix-closed: each holds a
    leading run of ``hashes`` and nothing after it, so the set of them holding block *i*
    only shrinks as *i* grows, and bisection between two blocks held by the same workers
    can skip everything between them. O(changes × log n) lookups."""
    get = masks.get
    n = len(hashes)
    first, last = get(hashes[0], 0) & bits, get(hashes[-1], 0) & bits
    out = [(0, bits & ~first), (n, last)]
    todo = [(0, n - 1, first, last)]
    while todo:
        lo, hi, m_lo, m_hi = todo.pop()
        if m_lo == m_hi:
            continue
        if hi - lo == 1:
            out.append((hi, m_lo & ~m_hi))  # held through block lo, not block hi
            continue
        mid = (lo + hi) // 2
        m_mid = get(hashes[mid], 0) & bits
        todo.append((lo, mid, m_lo, m_mid))
        todo.append((mid, hi, m_mid, m_hi))
    return out


def _drop_bit(masks: dict[int, int], h: int, bit: int) -> None:
    """Clear one worker's bit of block ``h`` in a hash → worker-bitmask index, dropping the
    entry once no worker holds the block."""
    mask = masks.get(h, 0) & ~bit
    if mask:
        masks[h] = mask
    else:
        masks.pop(h, None)
