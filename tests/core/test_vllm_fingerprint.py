"""vLLM-exact block hashes: our pure function against vectors computed by vLLM 0.32.0's own
``hash_block_tokens`` / ``init_none_hash`` / ``maybe_convert_block_hash`` with
``sha256_cbor`` (tests/data/vllm_block_hashes.json, made by
src/cachepilot/tooling/vllm/vectors.py in the vLLM venv)."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachepilot.core.fingerprint import (
    VLLM_DEFAULT_SEED,
    _vllm_block_digests_cbor2,
    external_hash,
    vllm_block_digests,
    vllm_block_hashes,
    vllm_none_hash,
)

from helpers.paths import DATA

VECTORS = json.loads((DATA / "vllm_block_hashes.json").read_text())


@pytest.mark.parametrize("case", VECTORS["cases"],
                         ids=lambda c: f"seed{c['seed']}-b{c['block_size']}-n{len(c['token_ids'])}")
def test_hashes_equal_vllms_own(case: dict) -> None:
    none_hash = vllm_none_hash(case["seed"] if case["seed"] is not None else VLLM_DEFAULT_SEED)
    assert none_hash.hex() == case["none_hash"]
    extra = tuple(case["extra_keys"]) if case["extra_keys"] else None
    got = vllm_block_hashes(case["token_ids"], case["block_size"], none_hash, extra)
    assert got == case["hashes"]
    assert len(got) == len(case["token_ids"]) // case["block_size"]  # full blocks only


def test_vectors_cover_what_matters() -> None:
    cases = VECTORS["cases"]
    assert VECTORS["vllm"].startswith("0.32.0") and VECTORS["algo"] == "sha256_cbor"
    assert any(c["seed"] is None for c in cases)  # vLLM's default seed
    assert any(len(c["token_ids"]) < c["block_size"] for c in cases)  # no full block: []
    assert any(h >= 1 << 63 for c in cases for h in c["hashes"])  # unsigned, not signed
    assert any(c["extra_keys"] for c in cases)


def test_chain_and_seed_properties() -> None:
    ids = list(range(2, 2 + 96))
    a = vllm_block_hashes(ids, 32, vllm_none_hash("0"))
    b = vllm_block_hashes([*ids[:64], *range(500, 532)], 32, vllm_none_hash("0"))
    assert a[:2] == b[:2] and a[2] != b[2]  # shared prefix, shared hashes
    assert vllm_block_hashes(ids, 32, vllm_none_hash("1"))[0] != a[0]  # seed roots the chain
    assert external_hash(bytes(range(32))) == int.from_bytes(bytes(range(24, 32)), "big")


def test_block_config_with_a_vllm_seed_fingerprints_as_vllm() -> None:
    from cachepilot.core.fingerprint import BlockConfig, fingerprint

    case = next(c for c in VECTORS["cases"] if c["seed"] == "0" and c["block_size"] == 32
                and not c["extra_keys"])
    fp = fingerprint("any-model", BlockConfig(32, vllm_seed="0"), token_ids=case["token_ids"])
    assert list(fp.hashes) == case["hashes"] and fp.tokens == len(case["token_ids"])
    plain = fingerprint("any-model", BlockConfig(32), token_ids=case["token_ids"])
    assert plain.hashes != fp.hashes  # without the seed: the xxh3 scheme, unchanged


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 300), st.integers(0, 70_000),
                          st.integers(0, (1 << 64) - 1)), max_size=120),
       st.sampled_from([1, 2, 16, 23, 24, 25, 32]),
       st.sampled_from([None, ("salt",), (1, "lora", b"x")]))
def test_vectorised_cbor_chain_equals_cbor2_per_block(ids, block_size, extra) -> None:
    """The numpy encoder and the C-looped chain give cbor2's bytes, hence vLLM's hashes,
    for ids of every CBOR width (1, 2, 3, 5 and 9 bytes) and array heads of 1 and 2 bytes."""
    none_hash = vllm_none_hash("0")
    expect = _vllm_block_digests_cbor2(ids, block_size, none_hash, extra)
    assert vllm_block_digests(ids, block_size, none_hash, extra) == expect
    assert vllm_block_digests(np.asarray(ids, dtype=np.uint64), block_size, none_hash,
                              extra) == expect


def test_a_chain_continues_from_any_block() -> None:
    ids = list(range(1000, 1000 + 160))
    whole = vllm_block_digests(ids, 16, vllm_none_hash("0"))
    assert vllm_block_digests(ids[64:], 16, whole[3]) == whole[4:]
