"""The simulated engine publishes the same KV events as vLLM (tooling/kv_event_publisher.py:
EngineTap → KVEventPublisher), and the gateway's subscriber (gateway/kv_events.py) turns
them into a directory that agrees with the engine: the same blocks, and every prediction
equal to the engine's own cache lookup, through evictions."""

import asyncio
import random

from cachepilot.core.directory import PrefixDirectory
from cachepilot.core.fingerprint import BlockConfig, fingerprint
from cachepilot.gateway.kv_events import Endpoints, KVEventHub
from cachepilot.sim.engine import Engine, EngineConfig, EngineRequest
from cachepilot.tooling.kv_event_publisher import EngineTap, KVEventPublisher

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
            for _ in range(50):  # let events land, then predict as the gateway would
                if d.mode("sim") == "exact" and set(d.event_blocks("sim")) == held(engine):
                    break
                await asyncio.sleep(0.02)
            assert set(d.event_blocks("sim")) == held(engine)
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
