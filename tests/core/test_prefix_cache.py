"""The Fingerprinter reuses a recent long prompt's work and must give exactly what
fingerprinting the whole prompt gives: byte blocks, token blocks, vLLM's digests."""

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachepilot.core.fingerprint import (
    BlockConfig,
    HFTokens,
    fingerprint,
    vllm_block_hashes,
    vllm_none_hash,
)
from cachepilot.core.prefix_cache import ChainCache, Fingerprinter, SplicingEncoder, common_prefix

WORDS = ["the", "cache", "prefix", "model", "token", "router", "gateway", "engine", "block",
         "hash", "of", "and", "to", "in", "é", "日本", "\n", "  "]


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def gemma_like() -> HFTokens:
    """A BPE like Gemma's: spaces become ▁ before the model sees the text, no
    pre-tokenisation, merges across word boundaries (tokens like '▁the▁router'), BOS."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, normalizers, pre_tokenizers, processors, trainers

    rng = random.Random(0)
    tok = tokenizers.Tokenizer(models.BPE(byte_fallback=True, unk_token=None))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.train_from_iterator([text(rng, 50) for _ in range(200)], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<bos>"], show_progress=False))
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tok.token_to_id("<bos>"))])
    return HFTokens(tok, special=True)


def test_common_prefix() -> None:
    assert common_prefix(b"abcdef", b"abcxyz") == 3
    assert common_prefix(b"abc", b"abcdef") == 3
    assert common_prefix(np.array([1, 2, 3]), np.array([1, 2, 4])) == 2


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=3000), st.binary(max_size=200), st.binary(max_size=200))
def test_common_prefix_of_bytes_is_the_first_difference(shared, x, y) -> None:
    """The bisection on slices agrees with the definition, wherever the texts part (in the
    last 64-byte stretch it scans byte by byte, or before)."""
    a, b = shared + x, shared + y
    naive = next((i for i, (p, q) in enumerate(zip(a, b, strict=False)) if p != q),
                 min(len(a), len(b)))
    assert common_prefix(a, b) == naive
    assert common_prefix(a, b) == common_prefix(np.frombuffer(a, np.uint8),
                                                np.frombuffer(b, np.uint8))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 30_000), st.binary(max_size=300)),
                min_size=1, max_size=6))
def test_byte_blocks_equal_the_whole_prompts(prompts) -> None:
    docs = [bytes([65 + d]) * 20_000 + bytes(range(256)) * 40 for d in range(3)]
    fpr = Fingerprinter(min_bytes=1024)
    cfg = BlockConfig(16, 4.0)
    for doc, cut, tail in prompts:
        prompt = (docs[doc][:cut] + tail).decode("latin-1")
        assert fpr("m", cfg, text=prompt) == fingerprint("m", cfg, text=prompt)
    assert fpr("other", cfg, text=prompt) == fingerprint("other", cfg, text=prompt)


def histories(seed: int, n: int = 25):  # type: ignore[no-untyped-def]
    """Agent-history and shared-document traffic: each prompt extends or forks an earlier
    one at any character."""
    rng = random.Random(seed)
    history = text(rng, 600)
    for _ in range(n):
        if rng.random() < 0.5:
            history += text(rng, rng.randrange(1, 40))  # the conversation grows
        yield history[:rng.randrange(len(history) // 2, len(history))] + text(rng, 5)


@pytest.mark.parametrize("special", [True, False])
def test_spliced_tokens_equal_the_whole_texts(gemma_like: HFTokens, special: bool) -> None:
    enc = SplicingEncoder(gemma_like, verify_every=1)  # every splice also checked whole
    for prompt in histories(1):
        assert enc(prompt, special) == gemma_like.tok.encode(
            prompt, add_special_tokens=special).ids
    assert enc.splicing and enc.counts["spliced"] > 10


def test_token_blocks_equal_the_whole_prompts(gemma_like: HFTokens) -> None:
    plain = HFTokens(gemma_like.tok, special=False)
    fpr = Fingerprinter(plain, min_bytes=1024)
    cfg = BlockConfig(16)
    for prompt in histories(3):
        assert fpr("m", cfg, text=prompt) == fingerprint("m", cfg, text=prompt, tokenizer=plain)
    assert fpr.encoder is not None and fpr.encoder.counts["spliced"] > 10


@pytest.mark.parametrize("lora,salt", [(None, None), (("ad", "/p/ad"), None), (None, "s1"),
                                       (("ad", "/p/ad"), "s2")])
def test_vllm_digests_reused_equal_the_whole_chain(lora, salt) -> None:
    rng = random.Random(4)
    cache = ChainCache(min_units=64)
    none_hash = vllm_none_hash("0")
    doc = [rng.randrange(262_144) for _ in range(900)]
    for i in range(12):
        ids = doc[:rng.randrange(100, 900)] + [rng.randrange(262_144) for _ in range(i)]
        assert cache.vllm_hashes(ids, 16, none_hash, lora=lora, cache_salt=salt) == \
            vllm_block_hashes(ids, 16, none_hash, lora=lora, cache_salt=salt)
    assert cache.counts["reused_blocks"] > 0


def test_a_splice_that_differs_switches_splicing_off(gemma_like: HFTokens, monkeypatch) -> None:
    rng = random.Random(2)
    enc = SplicingEncoder(gemma_like)
    doc = text(rng, 600)
    enc(doc + " first", True)

    def lying(*args: object) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ids, starts, ends = gemma_like.spans(doc + " second")
        return ids + 1, starts, ends

    monkeypatch.setattr(enc, "_splice", lying)
    assert enc(doc + " second", True) == gemma_like(doc + " second")
    assert not enc.splicing


def test_memory_is_bounded() -> None:
    cache = ChainCache(min_units=1024, entries=3)
    for i in range(10):
        cache.byte_hashes(f"{i:04d}".encode() * 2000, 64, 0)
    assert len(cache._lru.entries) == 3
    small = ChainCache(min_units=1024, max_bytes=20_000)
    for i in range(10):
        small.byte_hashes(f"{i:04d}".encode() * 2000, 64, 0)
    assert len(small._lru.entries) == 1
