"""The Fingerprinter reuses a recent long prompt's work and must give exactly what
fingerprinting the whole prompt gives: byte blocks, token blocks, vLLM's digests."""

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachepilot.core.fingerprint import BlockConfig, HFTokens, fingerprint
from cachepilot.core.prefix_cache import Fingerprinter, common_prefix

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


@pytest.mark.parametrize("seed", [None, "0"])
def test_spliced_tokens_and_digests_equal_the_whole_prompts(gemma_like: HFTokens,
                                                            seed: str | None) -> None:
    """Agent-history and shared-document traffic: each prompt extends or forks an earlier
    one at any character; every fingerprint is the whole prompt's."""
    rng = random.Random(1)
    fpr = Fingerprinter(gemma_like, verify_every=1)  # every splice also checked whole
    cfg = BlockConfig(16, vllm_seed=seed)
    history = text(rng, 600)
    for _ in range(25):
        if rng.random() < 0.5:
            history += text(rng, rng.randrange(1, 40))  # the conversation grows
        prompt = history[:rng.randrange(len(history) // 2, len(history))] + text(rng, 5)
        got = fpr("m", cfg, text=prompt)
        assert got == fingerprint("m", cfg, text=prompt, tokenizer=gemma_like)
    assert fpr.splicing and fpr.counts["spliced"] > 10


def test_a_splice_that_differs_switches_splicing_off(gemma_like: HFTokens, monkeypatch) -> None:
    rng = random.Random(2)
    fpr = Fingerprinter(gemma_like)
    cfg = BlockConfig(16, vllm_seed="0")
    doc = text(rng, 600)
    fpr("m", cfg, text=doc + " first")

    def lying(*args: object) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ids, starts, ends = gemma_like.spans(doc + " second")
        return ids + 1, starts, ends

    monkeypatch.setattr(fpr, "_splice", lying)
    got = fpr("m", cfg, text=doc + " second")
    assert got == fingerprint("m", cfg, text=doc + " second", tokenizer=gemma_like)
    assert not fpr.splicing


def test_memory_is_bounded() -> None:
    fpr = Fingerprinter(min_bytes=1024, entries=3)
    for i in range(10):
        fpr("m", BlockConfig(), text=f"{i:04d}" + "x" * 5000)
    assert len(fpr._entries) == 3
    small = Fingerprinter(min_bytes=1024, max_bytes=12_000)
    for i in range(10):
        small("m", BlockConfig(), text=f"{i:04d}" + "x" * 5000)
    assert len(small._entries) == 1
