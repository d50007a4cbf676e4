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
