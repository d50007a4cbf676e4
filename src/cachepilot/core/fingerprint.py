"""Chained block hashes over a prompt, the way vLLM names its KV blocks.

Block *i*'s hash covers its parent's hash and its own content, so two prompts share the
first *k* hashes exactly when they share the first *k* full blocks. Only full blocks are
hashed (a partial block is never reused by an engine either).
"""

from __future__ import annotations

import functools
import hashlib
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import cbor2
import numpy as np
from xxhash import xxh3_64_intdigest

Tokenizer = Callable[[str], Sequence[int]]


@dataclass(frozen=True, slots=True)
class BlockConfig:
    """How prompts are cut into blocks.

    With a tokenizer (or token-id prompts) a block is ``block_size`` tokens, as on the engine.
    Without one, a block is ``block_size * chars_per_token`` UTF-8 bytes: a stand-in that keeps
    the same *sharing* structure (same prefix → same hashes) and estimates token counts.
    """

    block_size: int = 16
    chars_per_token: float = 4.0
    # vLLM's hash seed (the engine's PYTHONHASHSEED; "vllm-none-hash" if it has none): when
    # set, token blocks are hashed exactly as a vLLM engine with sha256_cbor names them, so
    # its KV events speak of the same hashes (exact directory). None: xxh3 chains.
    vllm_seed: str | None = None

    @property
    def block_bytes(self) -> int:
        return max(1, round(self.block_size * self.chars_per_token))


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """A prompt's chained block hashes and its size in (estimated) tokens."""

    hashes: tuple[int, ...]
    tokens: int
    block_size: int
    # Set when the pool hashes as its engines do (exact) but this request could not be
    # reproduced exactly (cachepilot.core.vllm_prompt.NotExact's reason): its hashes are the
    # approximate scheme's, matched against the routing-learned directory only.
    fallback: str | None = None

    @property
    def blocks(self) -> int:
        return len(self.hashes)


def chain_hashes(buf: bytes | memoryview, block_bytes: int, seed: int = 0) -> list[int]:
    """Hash every full ``block_bytes`` block of ``buf``, each seeded with its parent's hash.

    xxh3 is C-backed and its 64-bit seed is the chaining link, so one call per block and
    no concatenation. The blocks are cut by numpy (one C call) and the chain runs inside
    C too (:func:`feedback_chain`): ~50 ns a block, ~0.17 ms for 220 KB here, against
    ~0.45 ms for the same loop written in Python.
    """
    n = len(buf) // block_bytes
    if n <= 0:
        return []
    blocks = np.frombuffer(buf, dtype=np.dtype((np.void, block_bytes)), count=n).tolist()
    return feedback_chain(xxh3_64_intdigest, blocks, seed)


def feedback_chain(step: Callable[[Any, Any], Any], items: list[Any], first: Any) -> list[Any]:
    """``[step(items[0], first), step(items[1], <that>), …]``: a chain where each result
    seeds the next, with no Python bytecode per item.

    ``map`` pulls each seed from an iterator over the output list while ``list.extend``
    appends every result as it comes (CPython's list iterator re-reads the length on each
    step), so the loop runs in C. :data:`_FEEDBACK_OK` checks that behaviour once at import
    and the Python loop below takes over if a runtime ever differs."""
    if not _FEEDBACK_OK:
        out, prev = [], first
        for item in items:
            prev = step(item, prev)
            out.append(prev)
        return out
    out = [first]
    out.extend(map(step, items, iter(out)))
    del out[0]
    return out


def _feedback_works() -> bool:
    out = [1]
    out.extend(map(operator.add, [1, 2, 3], iter(out)))
    return out == [1, 2, 4, 7]


_FEEDBACK_OK = _feedback_works()


def model_seed(model: str) -> int:
    """Root of every chain: different models never share KV blocks."""
    return xxh3_64_intdigest(model.encode())


def load_tokenizer(path: str) -> Tokenizer:
    """A Hugging Face ``tokenizer.json`` (the `tokenizers` library, optional extra): the
    model's own ids make the gateway's blocks the engine's blocks."""
    return HFTokens(_hf_tokenizer(path, "--tokenizer"), special=False)


def _hf_tokenizer(path: str, what: str) -> Any:
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:  # pragma: no cover - depends on the installed extras
        raise RuntimeError(f"{what} needs: pip install 'cachepilot[tokenizers]'") from None
    return HFTokenizer.from_file(path)


class HFTokens:
    """A Hugging Face tokenizer as a :data:`Tokenizer` (text → ids) that can also say where
    each token lies in the text (:meth:`spans`), which splicing a cached prefix's tokens
    onto a fresh tail needs (:mod:`cachepilot.core.prefix_cache`). ``special``: add the
    special tokens the post-processor adds (BOS), as vLLM does."""

    def __init__(self, tok: Any, *, special: bool) -> None:
        self.tok = tok
        self.special = special

    def __call__(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=self.special).ids

    def spans(self, text: str, *, special: bool | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, starts, ends): character offsets of each token in ``text``."""
        enc = self.tok.encode(text, add_special_tokens=self.special if special is None
                              else special)
        offsets = np.array(enc.offsets, dtype=np.int64).reshape(-1, 2)
        return np.array(enc.ids, dtype=np.int64), offsets[:, 0], offsets[:, 1]


def token_bytes(token_ids: Sequence[int]) -> bytes:
    return np.asarray(token_ids, dtype=np.uint32).tobytes()


def fingerprint(model: str, config: BlockConfig, *, text: str = "",
                token_ids: Sequence[int] | None = None,
                tokenizer: Tokenizer | None = None) -> Fingerprint:
    """Fingerprint a prompt: token blocks when ids are known, byte blocks otherwise."""
    seed = model_seed(model)
    if token_ids is None and tokenizer is not None:
        token_ids = tokenizer(text)
    if token_ids is not None and config.vllm_seed is not None:
        hashes = vllm_block_hashes(token_ids, config.block_size, _none_hash(config.vllm_seed))
        return Fingerprint(tuple(hashes), len(token_ids), config.block_size)
    if token_ids is not None:
        hashes = chain_hashes(token_bytes(token_ids), config.block_size * 4, seed)
        return Fingerprint(tuple(hashes), len(token_ids), config.block_size)
    raw = text.encode()
    hashes = chain_hashes(raw, config.block_bytes, seed)
    tokens = max(1, round(len(raw) / config.chars_per_token)) if raw else 0
    return Fingerprint(tuple(hashes), tokens, config.block_size)


# -- vLLM-exact block hashes (issue 13) ------------------------------------------------------
# vLLM names each full block H((parent, tuple(block_token_ids), extra_keys)) with the first
# block's parent NONE_HASH = H(seed) (vllm/v1/core/kv_cache_utils.py: hash_block_tokens,
# init_none_hash). With --prefix-caching-hash-algo sha256_cbor, H is sha256 over canonical
# CBOR (vllm/utils/hashing.py: sha256_cbor), reproducible in any process; the seed is the
# engine's PYTHONHASHSEED (else "vllm-none-hash"), so the gateway must be told the same one.
# KV events carry each hash as the digest's last 8 bytes, big-endian, as an unsigned int
# (maybe_convert_block_hash): that is the key the directory uses.

VLLM_DEFAULT_SEED = "vllm-none-hash"


def sha256_cbor(obj: object) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def vllm_none_hash(seed: str = VLLM_DEFAULT_SEED) -> bytes:
    """The parent of every first block: sha256_cbor of the seed string."""
    return sha256_cbor(seed)


cached_none_hash = functools.lru_cache(maxsize=8)(vllm_none_hash)
_none_hash = cached_none_hash


def external_hash(digest: bytes) -> int:
    """A block digest as KV events carry it: its last 8 bytes, big-endian, unsigned."""
    return int.from_bytes(digest[-8:], "big")


def vllm_block_hashes(token_ids: Sequence[int], block_size: int,
                      none_hash: bytes, extra_keys: tuple[object, ...] | None = None, *,
                      lora: tuple[str, str] | None = None, cache_salt: str | None = None,
                      ) -> list[int]:
    """The event-form hashes of every *full* block of ``token_ids``, as vLLM computes them.

    ``token_ids`` are the engine's prompt ids (:mod:`cachepilot.core.vllm_prompt`);
    ``none_hash`` is :func:`vllm_none_hash` of the engine's seed. Each block's extra keys are
    vLLM 0.32's ``generate_block_hash_extra_keys``: ``("lora", name, path)`` on every block of
    a LoRA request, then ``("cache_salt", salt)`` on the first block only (it still changes
    every later hash through the chain); None when a block has none. ``extra_keys``, if
    given instead, goes into every block as it is (vectors of vLLM's ``hash_block_tokens``).
    """
    first, rest = block_keys(extra_keys, lora, cache_salt)
    digests = vllm_block_digests(token_ids[:block_size], block_size, none_hash, first)
    if digests:
        digests += vllm_block_digests(token_ids[block_size:], block_size, digests[0], rest)
    return [external_hash(d) for d in digests]


def block_keys(extra_keys: tuple[object, ...] | None, lora: tuple[str, str] | None,
               cache_salt: str | None) -> tuple[object, object]:
    """The extra keys of a chain's first block and of every later one (see
    :func:`vllm_block_hashes`)."""
    if lora is None and not cache_salt:
        return extra_keys, extra_keys
    lora_key = ("lora", *lora) if lora is not None else None
    tagged = [lora_key] if lora_key is not None else []
    first = (*tagged, ("cache_salt", cache_salt)) if cache_salt else tuple(tagged)
    return first or None, tuple(tagged) or None


def vllm_block_digests(token_ids: Sequence[int], block_size: int, parent: bytes,
                       extra_keys: object = None) -> list[bytes]:
    """The sha256_cbor digest of every full block of ``token_ids``, the first chained on
    ``parent`` (the none hash, or the digest of the block before when continuing a chain).

    Canonical CBOR of ``(parent, tuple(block), extra_keys)`` is a fixed head, the parent's
    32 bytes and one segment per block (array header, each id as a minimal unsigned int,
    the encoded ``extra_keys``): the segments for all blocks come from one numpy pass
    (:func:`cbor_token_segments`) and the SHA-256 chain runs in C (:func:`_sha256_chain`),
    ~10× faster than cbor2 per block at long prompts, byte for byte the same."""
    n = len(token_ids) // block_size
    if n <= 0:
        return []
    full = token_ids[:n * block_size]
    ids = np.asarray(full)
    if len(parent) != 32 or ids.dtype.kind not in "ui" or int(ids.min()) < 0:
        # Not a hash chain we know, or ids numpy cannot hold exactly: the reference.
        return _vllm_block_digests_cbor2([int(i) for i in full], block_size, parent,
                                         extra_keys)
    trailer = cbor2.dumps(extra_keys, canonical=True)
    return _sha256_chain(cbor_token_segments(ids.astype(np.uint64), block_size, trailer), parent)


# sha256_cbor((parent, tokens, extra)): a 3-array, then the parent as a 32-byte string.
_CBOR_HEAD = b"\x83\x58\x20"


def _sha256_chain(segments: list[bytes], parent: bytes) -> list[bytes]:
    """``digest_i = sha256(_CBOR_HEAD + digest_{i-1} + segments[i])``, looped in C (the
    same feedback as :func:`feedback_chain`)."""
    if not _FEEDBACK_OK:
        out: list[bytes] = []
        for seg in segments:
            parent = hashlib.sha256(_CBOR_HEAD + parent + seg).digest()
            out.append(parent)
        return out
    out = [parent]
    heads = map(operator.concat, repeat(_CBOR_HEAD), iter(out))
    messages = map(operator.concat, heads, segments)
    out.extend(map(_DIGEST, map(hashlib.sha256, messages)))
    del out[0]
    return out


_DIGEST = operator.methodcaller("digest")
# Minimal CBOR unsigned ints by encoded length: (length, the head byte's additional info).
_CBOR_UINTS = ((2, 0x18), (3, 0x19), (5, 0x1A), (9, 0x1B))


def cbor_head(major: int, n: int) -> bytes:
    """Canonical CBOR head of major type ``major`` with argument ``n`` (minimal length)."""
    if n < 24:
        return bytes([major << 5 | n])
    for length, info in _CBOR_UINTS:
        if n < 1 << (8 * (length - 1)):
            return bytes([major << 5 | info]) + n.to_bytes(length - 1, "big")
    raise ValueError(f"CBOR argument out of range: {n}")


# A token's 5 slot bytes are its head, then its value as 4 big-endian bytes; of an id of
# kind k (0..3: encoded in 1, 2, 3 or 5 bytes) column c is kept when k >= _KEEP_FROM[c].
_KEEP_FROM = np.array([0, 3, 3, 2, 1], dtype=np.int8)
_HEADS = np.array([0, 0x18, 0x19, 0x1A], dtype=np.uint8)
_LENGTHS = np.array((1, 2, 3, 5), dtype=np.int64)


def cbor_token_segments(ids: np.ndarray, block_size: int, trailer: bytes) -> list[bytes]:
    """Per full block of ``ids`` (unsigned): its CBOR array of minimal unsigned ints, then
    ``trailer``. Every id gets a 5-byte slot (head byte, 4 value bytes) in one numpy array
    and a mask keeps its minimal encoding's bytes, so all blocks are encoded without a
    Python loop, then sliced. Ids of 2^32 and above (no tokenizer has them) go to cbor2."""
    n = len(ids) // block_size
    t = ids[:n * block_size]
    if t.size and int(t.max()) >= 1 << 32:
        return [cbor2.dumps(tuple(map(int, t[i:i + block_size])), canonical=True) + trailer
                for i in range(0, n * block_size, block_size)]
    t = t.astype(np.uint32)
    kind = (t >= 24).astype(np.int8) + (t >= 256) + (t >= 65536)  # 0..3: 1, 2, 3, 5 bytes
    slots = np.empty((t.size, 5), dtype=np.uint8)
    slots[:, 1:] = t.astype(">u4").view(np.uint8).reshape(-1, 4)
    slots[:, 0] = np.where(kind == 0, t.astype(np.uint8), _HEADS[kind])
    data = slots[kind[:, None] >= _KEEP_FROM].tobytes()
    ends = np.cumsum(_LENGTHS[kind].reshape(n, block_size).sum(axis=1))
    starts = ends.copy()
    starts[1:] = ends[:-1]
    starts[0] = 0
    head = cbor_head(4, block_size)
    payloads = map(data.__getitem__, map(slice, starts.tolist(), ends.tolist()))
    return list(map(operator.concat, map(operator.concat, repeat(head), payloads),
                    repeat(trailer)))


def _vllm_block_digests_cbor2(ids: list[int], block_size: int, parent: bytes,
                              extra_keys: object) -> list[bytes]:
    """The reference: cbor2 per block, as vLLM's own ``hash_block_tokens`` does."""
    out: list[bytes] = []
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = sha256_cbor((parent, tuple(ids[start:start + block_size]), extra_keys))
        out.append(parent)
    return out


def load_vllm_tokenizer(path: str) -> Tokenizer:
    """The model's ``tokenizer.json`` encoding as vLLM does for a completions prompt: with
    the special tokens its post-processor adds (BOS), so block 0 is the engine's block 0."""
    return HFTokens(_hf_tokenizer(path, "vLLM fingerprints"), special=True)
