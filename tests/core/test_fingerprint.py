import importlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachepilot.core.fingerprint import BlockConfig, chain_hashes, fingerprint, load_tokenizer

CFG = BlockConfig(block_size=4, chars_per_token=2.0)  # 8-byte blocks keep examples small


@given(st.binary(max_size=200), st.binary(max_size=200), st.binary(max_size=200))
def test_shared_full_blocks_give_shared_hashes_and_nothing_else(a: bytes, b: bytes,
                                                                shared: bytes) -> None:
    x, y = chain_hashes(shared + a, 8), chain_hashes(shared + b, 8)
    common = 0
    for i in range(0, min(len(shared + a), len(shared + b)) - 7, 8):
        if (shared + a)[i:i + 8] != (shared + b)[i:i + 8]:
            break
        common += 1
    k = 0
    while k < min(len(x), len(y)) and x[k] == y[k]:
        k += 1
    assert k == common  # equal exactly as far as the blocks agree (chaining)


@given(st.binary(max_size=300))
def test_only_full_blocks_are_hashed(data: bytes) -> None:
    assert len(chain_hashes(data, 8)) == len(data) // 8


def test_chaining_means_a_changed_block_changes_every_later_hash() -> None:
    a = chain_hashes(b"A" * 8 + b"B" * 8 + b"C" * 8, 8)
    b = chain_hashes(b"X" * 8 + b"B" * 8 + b"C" * 8, 8)
    assert all(p != q for p, q in zip(a, b, strict=True))


def test_models_never_share_blocks() -> None:
    a = fingerprint("m1", CFG, text="same prompt, same prompt")
    b = fingerprint("m2", CFG, text="same prompt, same prompt")
    assert a.hashes and not set(a.hashes) & set(b.hashes)


def test_token_ids_and_tokenizer_use_token_blocks() -> None:
    ids = list(range(10))
    fp = fingerprint("m", CFG, token_ids=ids)
    assert (fp.tokens, fp.blocks, fp.block_size) == (10, 2, 4)
    words = {w: i for i, w in enumerate(["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"])}
    fp2 = fingerprint("m", CFG, text="a b c d e f g h i j",
                      tokenizer=lambda s: [words[w] for w in s.split()])
    assert fp2.hashes == fp.hashes


def test_text_mode_estimates_tokens() -> None:
    fp = fingerprint("m", BlockConfig(16, 4.0), text="x" * 1000)
    assert fp.tokens == 250 and fp.blocks == 1000 // 64


def test_hugging_face_tokenizer_file_gives_token_blocks(tmp_path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    words = ["[UNK]", "the", "cache", "holds", "every", "prefix", "block"]
    vocab = {w: i for i, w in enumerate(words)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    text = "the cache holds every prefix block " * 3
    fp = fingerprint("m", CFG, text=text, tokenizer=load_tokenizer(str(path)))
    ids = [vocab[w] for w in text.split()]
    assert fp == fingerprint("m", CFG, token_ids=ids) and fp.tokens == 18


def _chain_reference(data: bytes, block: int, seed: int) -> list[int]:
    """The per-block loop the C-driven chain replaced: its values must not change."""
    from xxhash import xxh3_64_intdigest

    out, h = [], seed
    for start in range(0, len(data) - block + 1, block):
        h = xxh3_64_intdigest(data[start:start + block], h)
        out.append(h)
    return out


@given(st.binary(max_size=400), st.integers(1, 70), st.integers(0, (1 << 64) - 1))
def test_chain_hashes_are_the_per_block_loops(data: bytes, block: int, seed: int) -> None:
    assert chain_hashes(data, block, seed) == _chain_reference(data, block, seed)
    assert chain_hashes(memoryview(data), block, seed) == _chain_reference(data, block, seed)


def test_feedback_chain_without_the_c_loop_gives_the_same(monkeypatch) -> None:
    fpmod = importlib.import_module("cachepilot.core.fingerprint")  # the name is shadowed

    data = bytes(range(256)) * 3
    fast = chain_hashes(data, 16, 7)
    monkeypatch.setattr(fpmod, "_FEEDBACK_OK", False)
    assert chain_hashes(data, 16, 7) == fast == _chain_reference(data, 16, 7)
