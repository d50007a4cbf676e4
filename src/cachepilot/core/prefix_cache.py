"""Fingerprints of long prompts that begin like a recent one: only the new part is hashed
(and, with a tokenizer, tokenised).

Long prompts are long because they repeat: a document, a code base, an agent's history,
then a short new tail. Hashing (~50 ns a 64-byte block) and above all tokenising (Gemma's
tokenizer takes ~190 ms for 220 KB, the whole text being one BPE word) grow with the whole
prompt although only the tail is new. A :class:`Fingerprinter` keeps the last long prompt
per (model, block layout, first ``head_bytes``) and reuses what a new prompt shares with it:

* bytes (no tokenizer): the common byte prefix is found by numpy; its full blocks' hashes
  are the cached ones exactly (a chained hash names its prefix); the rest is chained on.
* tokens: the cached prompt's tokens are kept up to ``margin`` characters before the texts
  differ; the text from ``overlap`` tokens before that cut is tokenised afresh, and the two
  are spliced where the fresh tokens agree with the cached ones (the same ids at the same
  offsets, ``agree`` tokens or more, up to the cut). BPE merges are local, so this is what
  tokenising the whole text gives; a splice whose fresh tokens never agree tokenises the
  whole text instead, and the first ``verify_first`` splices, then one in ``verify_every``,
  are checked against the whole text, splicing being switched off for good (logged) if one
  ever differs. Blocks whose tokens are the cached prompt's keep their cached hashes
  (exact mode: the sha256_cbor digests, so only new blocks are hashed).
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from xxhash import xxh3_64_intdigest

from cachepilot.core.fingerprint import (
    BlockConfig,
    Fingerprint,
    HFTokens,
    Tokenizer,
    _none_hash,
    chain_hashes,
    external_hash,
    fingerprint,
    model_seed,
    token_bytes,
    vllm_block_digests,
)

log = logging.getLogger("cachepilot.core")

Spans = tuple[np.ndarray, np.ndarray, np.ndarray]  # token ids, start and end offsets


@dataclass(slots=True)
class _Entry:
    raw: bytes
    hashes: list[int]
    ids: np.ndarray | None = None  # token mode: the prompt's tokens and their offsets
    starts: np.ndarray | None = None
    ends: np.ndarray | None = None
    digests: list[bytes] | None = None  # exact mode: each block's sha256_cbor digest

    @property
    def size(self) -> int:
        tokens = 0 if self.ids is None else 3 * self.ids.nbytes
        return len(self.raw) + 48 * len(self.hashes) + tokens


def common_prefix(a: bytes | np.ndarray, b: bytes | np.ndarray) -> int:
    """How many leading bytes (or array items) ``a`` and ``b`` share, compared by numpy."""
    x = np.frombuffer(a, np.uint8) if isinstance(a, bytes) else a
    y = np.frombuffer(b, np.uint8) if isinstance(b, bytes) else b
    n = min(len(x), len(y))
    diff = np.flatnonzero(x[:n] != y[:n])
    return int(diff[0]) if diff.size else n


class Fingerprinter:
    """:func:`~cachepilot.core.fingerprint.fingerprint` with a memory of recent long
    prompts (see the module's docstring). One per router: not thread-safe."""

    def __init__(self, tokenizer: Tokenizer | None = None, *, min_bytes: int = 16384,
                 min_token_bytes: int = 1024, head_bytes: int = 1024, entries: int = 32,
                 max_bytes: int = 64 << 20, margin: int = 256, overlap: int = 32,
                 agree: int = 8, verify_first: int = 8, verify_every: int = 1024) -> None:
        self.tokenizer = tokenizer
        # Below these a prompt is fingerprinted whole: cheaper than looking it up.
        self.min_bytes = min_token_bytes if tokenizer is not None else min_bytes
        self.head_bytes = head_bytes
        self.max_entries, self.max_bytes = entries, max_bytes
        self.margin, self.overlap, self.agree = margin, overlap, agree
        self.verify_first, self.verify_every = verify_first, verify_every
        self.splicing = isinstance(tokenizer, HFTokens)
        self.counts: Counter[str] = Counter()  # hits, misses, splices, fallbacks, …
        self._entries: OrderedDict[tuple[object, ...], _Entry] = OrderedDict()
        self._bytes = 0

    def __call__(self, model: str, config: BlockConfig, *, text: str = "",
                 token_ids: Sequence[int] | None = None) -> Fingerprint:
        raw = text.encode() if token_ids is None else b""
        if len(raw) < self.min_bytes or (self.tokenizer is not None and not self.splicing):
            return fingerprint(model, config, text=text, token_ids=token_ids,
                               tokenizer=self.tokenizer)
        key = (model, config, xxh3_64_intdigest(raw[:self.head_bytes]))
        old = self._entries.get(key)
        self.counts["hits" if old is not None else "misses"] += 1
        if self.tokenizer is None:
            entry = self._by_bytes(raw, config, model_seed(model), old)
            fp = Fingerprint(tuple(entry.hashes), max(1, round(len(raw) / config.chars_per_token)),
                             config.block_size)
        else:
            entry = self._by_tokens(text, raw, config, model_seed(model), old)
            assert entry.ids is not None
            fp = Fingerprint(tuple(entry.hashes), len(entry.ids), config.block_size)
        self._keep(key, entry, old)
        return fp

    # -- bytes ---------------------------------------------------------------------------------
    @staticmethod
    def _by_bytes(raw: bytes, config: BlockConfig, seed: int, old: _Entry | None) -> _Entry:
        bb = config.block_bytes
        k = 0 if old is None else min(common_prefix(raw, old.raw) // bb, len(old.hashes))
        start = old.hashes[k - 1] if k and old is not None else seed
        hashes = (old.hashes[:k] if k and old is not None else []) + chain_hashes(
            memoryview(raw)[k * bb:], bb, start)
        return _Entry(raw, hashes)

    # -- tokens --------------------------------------------------------------------------------
    def _by_tokens(self, text: str, raw: bytes, config: BlockConfig, seed: int,
                   old: _Entry | None) -> _Entry:
        ids, starts, ends = self._spans(text, raw, old)
        bs = config.block_size
        shared = 0
        if old is not None and old.ids is not None:
            shared = common_prefix(ids, old.ids) // bs
            shared = min(shared, len(old.hashes))
        reuse = old.hashes[:shared] if old is not None and shared else []
        digests = None
        if config.vllm_seed is not None:
            old_digests = (old.digests or []) if old is not None else []
            shared = min(shared, len(old_digests))
            parent = old_digests[shared - 1] if shared else _none_hash(config.vllm_seed)
            digests = old_digests[:shared] + vllm_block_digests(ids[shared * bs:], bs, parent)
            hashes = reuse[:shared] + [external_hash(d) for d in digests[shared:]]
        else:
            start = reuse[-1] if shared else seed
            hashes = reuse + chain_hashes(token_bytes(ids[shared * bs:]), bs * 4, start)
        return _Entry(raw, hashes, ids, starts, ends, digests)

    def _spans(self, text: str, raw: bytes, old: _Entry | None) -> Spans:
        tok = self.tokenizer
        assert isinstance(tok, HFTokens)
        spliced = None if old is None or old.ids is None else self._splice(text, raw, old, tok)
        if spliced is None:
            self.counts["whole"] += 1
            return tok.spans(text)
        self.counts["spliced"] += 1
        n = self.counts["spliced"]
        if n <= self.verify_first or n % self.verify_every == 0:
            whole = tok.spans(text)
            self.counts["verified"] += 1
            if not all(np.array_equal(a, b) for a, b in zip(whole, spliced, strict=True)):
                log.warning("a spliced tokenisation differed from the whole text's; "
                            "tokenising whole prompts from now on")
                self.splicing = False
                return whole
        return spliced

    def _splice(self, text: str, raw: bytes, old: _Entry, tok: HFTokens) -> Spans | None:
        """The cached tokens up to the cut, then the fresh ones; None when they never agree
        (or the shared prefix is too short to be worth it)."""
        assert old.ids is not None and old.starts is not None and old.ends is not None
        shared_bytes = common_prefix(raw, old.raw)
        shared_chars = len(raw[:shared_bytes].decode("utf-8", "ignore"))
        k = int(np.searchsorted(old.ends, shared_chars - self.margin, side="right")) - 1
        s = k - self.overlap
        if s < 1 or old.ends[s - 1] <= 0:
            return None
        cut = int(old.ends[s - 1])  # where the fresh text starts (a token's end: no gap)
        f_ids, f_starts, f_ends = tok.spans(text[cut:], special=False)
        f_starts, f_ends = f_starts + cut, f_ends + cut
        for s2 in range(s, k - self.agree + 2):
            f = int(np.searchsorted(f_starts, old.starts[s2]))
            m = k - s2 + 1
            if f + m > len(f_ids) or f_starts[f] != old.starts[s2]:
                continue
            if (np.array_equal(f_ids[f:f + m], old.ids[s2:k + 1])
                    and np.array_equal(f_starts[f:f + m], old.starts[s2:k + 1])
                    and np.array_equal(f_ends[f:f + m], old.ends[s2:k + 1])):
                tail = slice(f + m, None)
                return (np.concatenate((old.ids[:k + 1], f_ids[tail])),
                        np.concatenate((old.starts[:k + 1], f_starts[tail])),
                        np.concatenate((old.ends[:k + 1], f_ends[tail])))
        self.counts["no_agreement"] += 1
        return None

    # -- memory --------------------------------------------------------------------------------
    def _keep(self, key: tuple[object, ...], entry: _Entry, old: _Entry | None) -> None:
        if old is not None:
            self._bytes -= old.size
        self._entries[key] = entry
        self._entries.move_to_end(key)
        self._bytes += entry.size
        while self._entries and (len(self._entries) > self.max_entries
                                 or self._bytes > self.max_bytes):
            _, dropped = self._entries.popitem(last=False)
            self._bytes -= dropped.size
