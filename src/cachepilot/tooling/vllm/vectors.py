"""Known block-hash vectors from vLLM's own functions, for tests/core/test_vllm_fingerprint.py.

Run with the vLLM venv's interpreter (it imports vLLM, never CachePilot):

    .venv-vllm/bin/python src/cachepilot/tooling/vllm/vectors.py > tests/data/vllm_block_hashes.json

Each case: the seed (PYTHONHASHSEED, or None for vLLM's default), block size, token ids and
extra keys, and what vLLM computes: NONE_HASH (hex) and the event-form hash of every full
block (``maybe_convert_block_hash`` with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES at its default).
"""

from __future__ import annotations

import json
import os
import random
import sys
from importlib.metadata import version


def main() -> int:
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils as kcu

    rng = random.Random(13)
    cases = []
    shapes = [("0", 32, 100, None), ("0", 32, 64, None), ("0", 16, 47, None),
              (None, 32, 96, None), ("1234", 128, 300, None), ("0", 32, 31, None),
              ("0", 32, 70, ("salt", "tenant-a"))]
    for seed, block, n, extra in shapes:
        if seed is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = seed
        kcu.init_none_hash(sha256_cbor)
        tokens = [2, *(rng.randrange(0, 262_144) for _ in range(n - 1))]  # BOS first, Gemma 3
        hashes, parent = [], None
        for start in range(0, n - block + 1, block):
            parent = kcu.hash_block_tokens(sha256_cbor, parent, tokens[start:start + block],
                                           extra)
            hashes.append(kcu.maybe_convert_block_hash(parent))
        cases.append({"seed": seed, "block_size": block, "token_ids": tokens,
                      "extra_keys": list(extra) if extra else None,
                      "none_hash": kcu.NONE_HASH.hex(), "hashes": hashes})
    json.dump({"vllm": version("vllm"), "algo": "sha256_cbor", "cases": cases}, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
