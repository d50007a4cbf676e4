"""Fault drills for the KV-event subscriber (datalayer/kv_events.py) against a real ZMQ
publisher with vLLM's wire format and replay protocol (tooling/kv_event_publisher.py):
the directory converges to the engine's truth within a stated time after lost events, a
subscriber restart, a worker restart that cleared its cache, an unfillable hole, a silent
publisher and a hostile stream.

Bound, with the timings below (tick 20 ms, heartbeat 0.2 s, replay timeout 0.3 s): a lost
batch, even the last one, is repaired within heartbeat + replay round trip (< BOUND_S); a
publisher that stops answering is dropped to approximate within stale_after + heartbeat.
"""


import msgspec
import pytest

from cachepilot.core.directory import PrefixDirectory
from cachepilot.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from cachepilot.datalayer.kv_events import Endpoints, KVEventHub
from cachepilot.datalayer.kv_wire import decode_batch
from cachepilot.tooling.kv_event_publisher import KVEventPublisher

from helpers.polling import seconds_until

TIMINGS = {"tick": 0.02, "heartbeat_every": 0.2, "replay_timeout": 0.3, "stale_after": 1.0}
BOUND_S = 1.0  # heartbeat + replay timeout + ticks, with margin for a loaded 2-core machine


class Engine:
    """A publisher plus the truth: the block set its events describe."""

    def __init__(self, **kw) -> None:
        self.pub = KVEventPublisher(**kw)
        self.truth: set[int] = set()

    def store(self, *hs: int) -> None:
        self.pub.publish([BlockStored(tuple(hs))])
        self.truth |= set(hs)

    def remove(self, *hs: int) -> None:
        self.pub.publish([BlockRemoved(tuple(hs))])
        self.truth -= set(hs)

    def clear(self) -> None:
        self.pub.publish([AllBlocksCleared()])
        self.truth.clear()

    def endpoints(self) -> Endpoints:
        return Endpoints(self.pub.endpoint, self.pub.replay_endpoint, "kv-events")


def directory(*workers: str) -> PrefixDirectory:
    d = PrefixDirectory(10_000)
    for w in workers:
        d.add_worker(w)
    return d


@pytest.fixture
async def hub():
    h = KVEventHub(**TIMINGS)
    yield h
    await h.stop()


def synced(d: PrefixDirectory, eng: Engine, mode: str = "exact", w: str = "w") -> bool:
    return d.mode(w) == mode and set(d.event_blocks(w)) == eng.truth


async def test_late_join_and_gaps_converge_to_the_truth(hub: KVEventHub) -> None:
    d, eng = directory("w"), Engine()
    eng.store(1, 2, 3)  # before anyone subscribed: only replay can bring it
    hub.attach("w", eng.endpoints(), d)
    await seconds_until(lambda: synced(d, eng))
    eng.pub.drop_next(2)  # two batches lost on the live socket ...
    eng.store(4)
    eng.remove(1)
    eng.store(5)  # ... the next one shows the gap
    t = await seconds_until(lambda: synced(d, eng))
    assert t < BOUND_S
    eng.pub.drop_next(1)
    eng.remove(2)  # the *last* batch lost: nothing later shows a gap; the heartbeat does
    t = await seconds_until(lambda: synced(d, eng))
    assert t < BOUND_S
    st = hub.status()["w"]
    assert st["gaps"] >= 1 and st["replayed_batches"] >= 3 and st["holes"] == 0
    assert d.match([3], ["w"]) == {"w": 1} and d.match([2], ["w"]) == {"w": 0}


async def test_subscriber_restart_rebuilds_from_replay() -> None:
    d, eng = directory("w"), Engine()
    hub = KVEventHub(**TIMINGS)
    hub.attach("w", eng.endpoints(), d)
    eng.store(1, 2)
    await seconds_until(lambda: synced(d, eng))
    await hub.stop()  # the gateway goes away ...
    assert d.mode("w") == "approximate"
    eng.remove(1)
    eng.store(7, 8)
    hub2 = KVEventHub(**TIMINGS)  # ... and comes back with an empty directory
    d2 = directory("w")
    try:
        hub2.attach("w", eng.endpoints(), d2)
        t = await seconds_until(lambda: synced(d2, eng))
        assert t < BOUND_S and hub2.status()["w"]["holes"] == 0
    finally:
        await hub2.stop()


async def test_worker_restart_that_cleared_its_cache(hub: KVEventHub) -> None:
    d, eng = directory("w"), Engine()
    hub.attach("w", eng.endpoints(), d)
    eng.store(1, 2, 3)
    await seconds_until(lambda: synced(d, eng))
    eng.pub.restart()  # a new engine: numbers from 0, an empty cache
    eng.truth.clear()
    eng.store(9)
    t = await seconds_until(lambda: synced(d, eng))
    assert t < BOUND_S and hub.status()["w"]["restarts"] == 1
    assert d.match([1], ["w"]) == {"w": 0}  # never routed on the old engine's blocks


async def test_an_unfillable_hole_degrades_until_the_engine_clears(hub: KVEventHub) -> None:
    d, eng = directory("w"), Engine(buffer_steps=3)
    for k in range(10):  # the replay buffer keeps only the last 3 of these
        eng.store(k)
    d.insert("w", [100])  # routing-learned
    hub.attach("w", eng.endpoints(), d)
    await seconds_until(lambda: d.mode("w") == "degraded")
    assert set(d.event_blocks("w")) == {7, 8, 9}  # certain; 0..6 unknown
    assert d.match([7], ["w"]) == {"w": 1} and d.match([100], ["w"]) == {"w": 1}
    assert hub.status()["w"]["holes"] == 1
    eng.clear()
    eng.store(11)
    await seconds_until(lambda: synced(d, eng))
    assert d.match([100], ["w"]) == {"w": 0}


async def test_silent_publisher_falls_back_then_recovers(hub: KVEventHub) -> None:
    d, eng = directory("w"), Engine()
    hub.attach("w", eng.endpoints(), d)
    eng.store(1)
    await seconds_until(lambda: synced(d, eng))
    eng.pub.answer_replays = False  # the engine hangs: heartbeats go unanswered
    t = await seconds_until(lambda: d.mode("w") == "approximate")
    assert t < TIMINGS["stale_after"] + TIMINGS["heartbeat_every"] + BOUND_S
    assert d.event_blocks("w") == frozenset()  # the stale set is not trusted
    eng.pub.answer_replays = True
    await seconds_until(lambda: synced(d, eng))
    assert hub.status()["w"]["stale"] == 1


async def test_hostile_stream_is_counted_and_isolated(hub: KVEventHub) -> None:
    d, bad, good = directory("bad", "good"), Engine(), Engine()
    hub.attach("bad", bad.endpoints(), d)
    hub.attach("good", good.endpoints(), d)
    bad.store(1)
    good.store(1, 2)
    await seconds_until(lambda: synced(d, bad, w="bad") and synced(d, good, w="good"))
    enc = msgspec.msgpack.encode
    seq = bad.pub.next_seq
    bad.pub.publish_raw([b"kv-events", b"garbage"])  # wrong frame shape
    bad.pub.publish_raw([b"kv-events", (10**6).to_bytes(8, "big"), b"\xc1\xc1"])  # not msgpack
    unknown = enc([0.0, [{"type": "BlockTeleported", "block_hashes": [5]},
                         {"type": "BlockStored", "block_hashes": list(range(70_000)),
                          "parent_block_hash": None, "token_ids": [], "block_size": 32,
                          "lora_id": None, "medium": None, "lora_name": None},
                         {"type": "BlockStored", "block_hashes": ["x"]}], 0])
    # A forged number (the publisher reuses it next) costs a replay, not correctness.
    bad.pub.publish_raw([b"kv-events", seq.to_bytes(8, "big"), unknown])
    for _ in range(2000):  # a flood of well-formed batches
        bad.store(3)
    good.store(4)
    await seconds_until(lambda: synced(d, good, w="good") and 3 in d.event_blocks("bad"))
    st = hub.status()["bad"]
    assert st["malformed"] >= 2 and st["skipped_events"] == 3
    assert 5 not in d.event_blocks("bad") and 0 not in d.event_blocks("bad")
    assert set(d.event_blocks("good")) == {1, 2, 4}  # untouched by its neighbour


def test_decode_matches_vllms_struct_encoding() -> None:
    """The payload vLLM 0.32's msgspec structs produce (array-like batch, tagged maps, hashes
    above 2**63, bytes hashes when int hashes are off) decodes to the same events."""
    payload = msgspec.msgpack.encode([1.5, [
        {"type": "BlockStored", "block_hashes": [2**64 - 1, 7], "parent_block_hash": None,
         "token_ids": [2, 3], "block_size": 32, "lora_id": None, "medium": "GPU",
         "lora_name": None, "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
        {"type": "BlockRemoved", "block_hashes": [b"\x00" * 24 + (9).to_bytes(8, "big")],
         "medium": "GPU"},
        {"type": "AllBlocksCleared"}], 0])
    events, fmt, _ = decode_batch(payload)
    assert fmt.events == "map" and fmt.batch_fields == 3
    assert events == [BlockStored((2**64 - 1, 7), None, 32, 0, "full_attention", "GPU"),
                      BlockRemoved((9,), None, "GPU"), AllBlocksCleared()]


async def test_follow_pools_attaches_and_detaches_as_workers_come_and_go(hub) -> None:
    from types import SimpleNamespace

    from cachepilot.datalayer.kv_events import port_endpoints, sync_pools

    e1, e2 = Engine(), Engine()
    d = directory("10.0.0.1:8000", "10.0.0.2:8000")
    pool = SimpleNamespace(workers={"10.0.0.1:8000": object()}, directory=d)
    by_addr = {"10.0.0.1:8000": e1.endpoints(), "10.0.0.2:8000": e2.endpoints()}
    sync_pools(hub, {"p": pool}, lambda _p, a: by_addr[a])
    assert hub.workers() == ["10.0.0.1:8000"]
    e1.store(1)
    await seconds_until(lambda: synced(d, e1, w="10.0.0.1:8000"))
    pool.workers = {"10.0.0.2:8000": object()}  # one pod went, another came
    sync_pools(hub, {"p": pool}, lambda _p, a: by_addr[a])
    assert hub.workers() == ["10.0.0.2:8000"] and d.mode("10.0.0.1:8000") == "approximate"
    e2.store(5)
    await seconds_until(lambda: synced(d, e2, w="10.0.0.2:8000"))
    ep = port_endpoints(5557, 5558)("p", "10.1.2.3:8000")
    assert (ep.events, ep.replay, ep.topic) == ("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558",
                                                "kv-events")


def test_a_publisher_on_a_taken_port_raises_and_leaves_no_socket_behind() -> None:
    """A half-built publisher's open sockets, once garbage in a reference cycle (a kept
    traceback), would make the context's finaliser block the thread the collector next
    runs in: a 60-s stall in an unrelated test on CI."""
    import gc
    import threading

    import zmq

    def half_built(port: int) -> bool:
        try:
            KVEventPublisher(replay_endpoint=f"tcp://127.0.0.1:{port}")
        except zmq.ZMQError as exc:
            kept = exc  # frame → traceback → frame: a cycle only the collector frees
            return kept is not None
        return False

    with KVEventPublisher() as taken:
        assert half_built(int(taken.replay_endpoint.rsplit(":", 1)[1]))
    collected = threading.Thread(target=gc.collect, daemon=True)
    collected.start()
    collected.join(timeout=10)
    assert not collected.is_alive(), "collecting the half-built publisher hung"
