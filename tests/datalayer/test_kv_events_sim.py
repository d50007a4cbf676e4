"""The simulated engine publishes the same KV events as vLLM (tooling/kv_event_publisher.py:
EngineTap → KVEventPublisher), and the gateway's subscriber (datalayer/kv_events.py) turns
them into a directory that agrees with the engine: the same blocks, and every prediction
equal to the engine's own cache lookup, through evictions."""

import random
from pathlib import Path

import httpx
from aiohttp.test_utils import TestServer

from cachepilot.core.directory import PrefixDirectory
from cachepilot.core.fingerprint import BlockConfig, fingerprint
from cachepilot.datalayer.kv_events import Endpoints, KVEventHub
from cachepilot.sim.engine import Engine, EngineConfig, EngineRequest
from cachepilot.tooling.kv_event_publisher import EngineTap, KVEventPublisher
from cachepilot.tooling.sim_worker import WorkerConfig, make_app
from cachepilot.tooling.stack import LocalStack, StackConfig

from helpers.polling import eventually, until

BLOCK = BlockConfig(block_size=16)


def held(engine: Engine) -> set[int]:
    return set(engine._in_use) | set(engine._free_cached)


async def test_gateway_and_simulated_engine_agree_through_evictions() -> None:
    engine = Engine(EngineConfig(block_size=16, num_blocks=40, max_batch=4,
                                 max_batched_tokens=512))
    pub = KVEventPublisher()
    tap = EngineTap(engine, pub, 16)
    d = PrefixDirectory(40)
    d.add_worker("sim")
    hub = KVEventHub(tick=0.01, heartbeat_every=0.2, replay_timeout=0.3, stale_after=5.0)
    hub.attach("sim", Endpoints(pub.endpoint, pub.replay_endpoint, "kv-events"), d)
    rng = random.Random(7)
    docs = [" ".join(f"doc{g}-w{i}" for i in range(rng.randint(40, 90))) for g in range(8)]
    now, checked, hits = 0.0, 0, 0
    try:
        for i in range(60):
            text = rng.choice(docs) + f" question {i} " + "x" * rng.randint(0, 60)
            fp = fingerprint("m", BLOCK, text=text)
            # Let events land, then predict as the gateway would.
            await eventually(lambda: d.mode("sim") == "exact"
                             and set(d.event_blocks("sim")) == held(engine), timeout=5,
                             what=f"the events of the steps before request {i}")
            predicted = d.match(fp.hashes, ["sim"])["sim"]
            assert predicted == engine.cached_prefix_blocks(fp.hashes)
            checked += 1
            hits += predicted > 0
            engine.submit(EngineRequest(i, max(1, fp.tokens), fp.hashes, 2, now))
            while engine.has_work():
                now += engine.step(now).duration
                tap.after_step()
        assert checked == 60 and hits > 10 and engine.evictions > 0
        assert hub.status()["sim"]["holes"] == 0
    finally:
        await hub.stop()
        pub.close()


# -- the simulated worker (tooling/sim_worker.py) publishing, the gateway following ---------

WORKER = WorkerConfig(engine=EngineConfig(block_size=16, num_blocks=48, max_batch=4,
                                          max_batched_tokens=512), speed=50.0)


def _prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    docs = [" ".join(f"doc{g}-w{i}" for i in range(rng.randint(40, 90))) for g in range(6)]
    return [rng.choice(docs) + f" question {i} " + "x" * rng.randint(0, 60) for i in range(n)]


def _capped(blocks: int, prompt_tokens: int, bs: int) -> int:
    """The engine computes at least one prompt token (sim/engine.py _admit)."""
    if blocks * bs >= prompt_tokens:
        blocks = max(0, -(-prompt_tokens // bs) - 1)
    return blocks * bs


async def test_sim_worker_publishes_what_it_holds_and_the_directory_predicts_cached_tokens(
        ) -> None:
    app = make_app(WORKER, ("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"))
    worker, pub = app["worker"], app["worker"].publisher
    server = TestServer(app)
    await server.start_server()
    d = PrefixDirectory(48)
    d.add_worker("w")
    hub = KVEventHub(tick=0.01, heartbeat_every=0.2, replay_timeout=0.3, stale_after=5.0)
    hub.attach("w", Endpoints(pub.endpoint, pub.replay_endpoint, "kv-events"), d)
    block = BlockConfig(16, WORKER.chars_per_token)
    url = str(server.make_url("/v1/completions"))
    hits = 0
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            for i, prompt in enumerate(_prompts(50, 3)):
                # The last step's events land within a tick or two.
                await eventually(lambda: d.mode("w") == "exact" and set(d.event_blocks("w"))
                                 == held(worker.engine), timeout=5, interval=0.01,
                                 what=f"the events of the steps before request {i}")
                fp = fingerprint(WORKER.model, block, text=prompt)
                predicted = _capped(d.match(fp.hashes, ["w"])["w"], max(1, fp.tokens), 16)
                r = await client.post(url, json={"model": WORKER.model, "prompt": prompt,
                                                 "max_tokens": 2})
                r.raise_for_status()
                got = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert got == predicted, f"request {i}: predicted {predicted}, engine {got}"
                hits += got > 0
            listed = (await client.get(str(server.make_url("/debug/kv_blocks")))).json()
        assert set(listed["blocks"]) == held(worker.engine)
        assert hits >= 10 and worker.engine.evictions > 0
        st = hub.status()["w"]
        assert st["mode"] == "exact" and st["holes"] == 0 and st["malformed"] == 0
    finally:
        await hub.stop()
        await server.close()


def test_local_stack_with_kv_events_gateway_agrees_with_sim_workers(tmp_path: Path) -> None:
    """``cachepilot up --kv-events``'s stack: Envoy, the gateway subscribed to two simulated
    workers' events on their own loopback addresses. Every decision's predicted cached tokens
    equal the engine's, and afterwards the gateway's event set per worker holds as many blocks
    as the worker does (all of them in exact mode)."""
    cfg = StackConfig(workers=2, kv_events=True, speed=20.0, decision_log=str(tmp_path / "d"),
                      worker_args=("--num-blocks", "96"), log_dir=str(tmp_path / "logs"))
    with LocalStack(cfg) as stack, httpx.Client(timeout=30) as client:
        assert {a.split(":")[0] for a in stack.worker_addresses} == {"127.0.0.2", "127.0.0.3"}
        until(lambda: {w["directory_mode"] for w in client.get(
            f"{stack.admin_url}/workers").json()} == {"exact"}, 20, "every worker in exact mode",
            interval=0.1)

        def kv_state() -> tuple[dict[str, list[int]], dict[str, dict]]:
            """What each worker holds, and what the gateway follows of its events."""
            held = {a: client.get(f"http://{a}/debug/kv_blocks").json()["blocks"]
                    for a in stack.worker_addresses}
            return held, {w["address"]: w["kv_events"]
                          for w in client.get(f"{stack.admin_url}/workers").json()}

        def events_reached(before: tuple[dict[str, list[int]], dict[str, dict]]) -> bool:
            """Every worker's blocks are the gateway's event set, and a worker whose blocks
            changed since ``before`` has had a batch of its events applied since."""
            held, events = kv_state()
            for a in stack.worker_addresses:
                assert events[a]["event_blocks"] == len(held[a]) and (
                    held[a] == before[0][a]
                    or (events[a]["next_seq"] or 0) > (before[1][a]["next_seq"] or 0)), \
                    (a, events[a], len(held[a]))
            return True

        pairs = []
        for prompt in _prompts(40, 5):
            before = kv_state()
            r = client.post(f"{stack.url}/v1/completions", json={
                "model": cfg.model, "prompt": prompt, "max_tokens": 2})
            r.raise_for_status()
            got = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            rid = r.headers["x-cachepilot-decision-id"]

            def record(rid: str = rid) -> dict | None:
                resp = client.get(f"{stack.admin_url}/decisions/{rid}")
                return resp.json().get("record") if resp.status_code == 200 else None

            # The decision log commits in batches.
            rec = until(record, 5, f"decision {rid} in the log", interval=0.05)
            prompt_tokens = r.json()["usage"]["prompt_tokens"]
            predicted = _capped(rec["predicted_cached_tokens"] // 16, prompt_tokens, 16)
            pairs.append((predicted, got))
            # The step's events reach the gateway before the next request is routed.
            until(lambda before=before: events_reached(before), 10,
                  "the step's events reaching the gateway", retry_on=(AssertionError,))
        assert all(p == g for p, g in pairs), pairs
        assert sum(g > 0 for _, g in pairs) >= 15
        ws = {w["address"]: w for w in client.get(f"{stack.admin_url}/workers").json()}
        total = 0
        for addr in stack.worker_addresses:  # the policy may keep one worker idle
            held_now = client.get(f"http://{addr}/debug/kv_blocks").json()["blocks"]
            ev = ws[addr]["kv_events"]
            assert ws[addr]["directory_mode"] == "exact" and ev["holes"] == 0
            assert ev["event_blocks"] == len(held_now), (addr, ev, len(held_now))
            total += len(held_now)
        assert total > 0
