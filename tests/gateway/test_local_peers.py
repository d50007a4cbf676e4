"""The processes of one gateway share placements and bookings over local sockets."""

import asyncio
import os

import pytest

from cachepilot.core.cost import Weights
from cachepilot.core.fingerprint import BlockConfig
from cachepilot.core.request import InferenceRequest
from cachepilot.core.router import static_router
from cachepilot.core.sync import Finished, InFlight, Placed, ReplicaSync
from cachepilot.core.workers import WorkerMetrics
from cachepilot.gateway.local_peers import EVENTS, LocalPeers, decode, encode

from helpers.polling import eventually

WORKERS = ["127.0.0.1:8001", "127.0.0.1:8002"]


def test_frames_round_trip_with_hashes_as_raw_integers() -> None:
    events = [Placed("p0", "a", "default", WORKERS[0], (1, 2**63 + 5, 2**64 - 1), 30),
              Finished("p0", "a"), InFlight("p0", ("b", "c")),
              Placed("p0", "b", "default", WORKERS[1], (), 0)]
    frame = encode(EVENTS, events)
    assert int.from_bytes(frame[:4], "little") == len(frame) - 4
    assert decode(frame[4:]) == (EVENTS, events)


@pytest.mark.parametrize("junk", [b"", b"\x01\x05\x00\x00\x00[1,2]", b"\x01\x02\x00\x00\x00{}",
                                  b'\x01\x1b\x00\x00\x00[{"kind":"placed","hashes":3}]'])
def test_a_bad_frame_is_refused(junk: bytes) -> None:
    with pytest.raises(ValueError):
        decode(junk)


def router(name: str):  # type: ignore[no-untyped-def]
    r = static_router(WORKERS, policy="priced", weights=Weights(), models=(),
                      block=BlockConfig(4, 2.0), capacity_blocks=1000, engine="sim",
                      id_prefix=name)
    for w in WORKERS:
        r.pools["default"].update_metrics(w, WorkerMetrics(waiting=0, running=0,
                                                           scraped_at=0.0))
    sync = ReplicaSync(name)
    r.add_plugin(sync)
    return r, sync


def test_processes_see_each_others_placements_bookings_and_history() -> None:
    async def run() -> None:
        group = f"test-{os.getpid()}-{os.urandom(2).hex()}"
        (ra, sa), (rb, sb), (rc, sc) = router("p0"), router("p1"), router("p2")
        a = LocalPeers(ra, sa, group, 0, 3)
        b = LocalPeers(rb, sb, group, 1, 3)
        await a.start()
        await b.start()
        req = InferenceRequest(model="m", prompt="a shared document " * 20)
        d = ra.route(req, 0.1)
        fp = ra.fingerprint(req, ra.pools["default"])
        pool_b = rb.pools["default"]
        await eventually(lambda: pool_b.workers[d.chosen].inflight == 1)
        assert pool_b.directory.match(fp.hashes, WORKERS)[d.chosen] == fp.blocks
        # A process started later catches up from a snapshot.
        c = LocalPeers(rc, sc, group, 2, 3)
        await c.start()
        pool_c = rc.pools["default"]
        await eventually(lambda: pool_c.directory.match(fp.hashes, WORKERS)[d.chosen] == fp.blocks)
        ra.release(d)
        await eventually(lambda: pool_b.workers[d.chosen].inflight == 0)
        await eventually(lambda: a.status()["connected_peers"] == [1, 2])
        for p in (a, b, c):
            await p.stop()

    asyncio.run(run())
