"""Replica sync: another replica's placements and bookings count like our own, until their
end arrives or their TTL passes."""

from dataclasses import replace

import pytest

from cachepilot.core import InferenceRequest
from cachepilot.core.lifecycle import Outcome
from cachepilot.core.sync import (
    Finished,
    InFlight,
    Placed,
    Prefilled,
    ReplicaSync,
    event_from_dict,
    event_to_dict,
)
from cachepilot.sim import SimConfig, Simulator, WorkloadSpec, generate
from cachepilot.sim.measures import summarize

from helpers.routers import WORKERS, make_router

DOC = "a long shared document " * 80


def req(suffix: str = "") -> InferenceRequest:
    return InferenceRequest(model="m", prompt=DOC + suffix)


def pair() -> tuple:
    a, b = make_router(), make_router()
    sa, sb = ReplicaSync("a"), ReplicaSync("b")
    a.add_plugin(sa)
    b.add_plugin(sb)
    return a, b, sa, sb


def test_a_peer_placement_is_a_hit_and_its_booking_is_load_until_it_ends() -> None:
    a, b, sa, sb = pair()
    d = a.route(req("q1"), 100.0)
    (placed,) = sa.drain()
    assert isinstance(placed, Placed) and placed.worker == d.chosen
    sb.apply(placed, b, 100.0)
    w = b.pools["default"].workers[d.chosen]
    assert (w.inflight, w.pending_requests) == (1, 1)
    assert w.pending_prefill_tokens == d.uncached_tokens > 0
    # b now knows where a put the prefix, and that a request is being prefilled there.
    d2 = b.route(req("q2"), 100.0)
    there = next(c for c in d2.candidates if c.worker == d.chosen)
    assert there.matched_tokens > 0 and there.ahead_tokens >= d.uncached_tokens
    a.first_token(d, 50.0)
    a.release(d, Outcome(status=200))
    for e in sa.drain():
        sb.apply(e, b, 100.1)
    own = int(d2.chosen == d.chosen)  # only b's own request is left
    assert (w.inflight, w.pending_requests) == (own, own)
    assert sb.remote_bookings() == 0


def test_a_peer_placement_counts_as_an_arrival_for_congestion_pricing() -> None:
    # Congestion is priced on the pool's arrival rate: N replicas that each counted only
    # their own arrivals would each see a burst at 1/N of its rate.
    a, b, sa, sb = pair()
    for i in range(8):
        a.route(req(f"q{i}"), 100.0)
    for e in sa.drain():
        sb.apply(e, b, 100.0)
    rate_a = a.pools["default"].arrival_rate(100.0)
    assert rate_a > 0
    assert b.pools["default"].arrival_rate(100.0) == pytest.approx(rate_a)
    # A joining replica's catch-up is history: its placements are not arrivals now.
    c = make_router()
    sc = ReplicaSync("c")
    c.add_plugin(sc)
    for e in sa.snapshot():
        sc.apply(e, c, 100.0, live=False)
    assert sc.remote_bookings() == 8  # still in flight at a: booked
    assert c.pools["default"].arrival_rate(100.0) == 0.0


def test_a_heartbeat_ends_bookings_whose_end_was_lost_and_a_silent_replica_is_dropped() -> None:
    a, b, sa, sb = pair()
    d1, d2 = a.route(req("q1"), 100.0), a.route(req("q2"), 100.0)
    for e in sa.drain():
        sb.apply(e, b, 100.0)
    assert sb.remote_bookings() == 2
    a.release(d1, Outcome(status=200))
    sa.drain()  # d1's Finished is lost
    sa.heartbeat()
    (beat,) = sa.drain()
    assert isinstance(beat, InFlight) and beat.ids == (d2.id,)
    sb.apply(beat, b, 101.0)
    assert sb.remote_bookings() == 1
    assert sb.expire(b, 101.0 + sb.silent_after_s - 0.1) == 0
    assert sb.expire(b, 101.0 + sb.silent_after_s) == 1  # a fell silent: d2 is dropped too
    assert all(w.inflight == 0 for w in b.pools["default"].workers.values())


def test_own_events_duplicates_and_unknown_workers_change_nothing() -> None:
    a, b, sa, sb = pair()
    d = a.route(req(), 100.0)
    (placed,) = sa.drain()
    sa.apply(placed, a, 100.0)  # its own
    assert a.pools["default"].workers[d.chosen].inflight == 1
    sb.apply(placed, b, 100.0)
    sb.apply(placed, b, 100.0)  # delivered twice
    assert b.pools["default"].workers[d.chosen].inflight == 1
    sb.apply(replace(placed, id="x", worker="10.9.9.9:1"), b, 100.0)
    sb.apply(Finished("a", "never-placed"), b, 100.0)
    assert sb.remote_bookings() == 1


def test_lost_ends_expire_after_the_ttl() -> None:
    a, b, sa, sb = pair()
    sb.booking_ttl_s = 5.0
    d = a.route(req(), 100.0)
    sb.apply(sa.drain()[0], b, 100.0)
    assert sb.expire(b, 104.0) == 0
    assert sb.expire(b, 105.0) == 1
    w = b.pools["default"].workers[d.chosen]
    assert (w.inflight, w.pending_requests, w.pending_prefill_tokens) == (0, 0, 0)


def test_events_survive_a_round_trip_and_garbage_is_refused() -> None:
    events = [Placed("a", "1", "default", WORKERS[0], (1, 2**64 - 1), 7),
              Prefilled("a", "1"), Finished("a", "1"), InFlight("a", ("1", "2"))]
    assert [event_from_dict(event_to_dict(e)) for e in events] == events
    for bad in ({}, {"kind": "placed", "replica": "a"}, {"kind": "nope", "replica": "a",
                                                         "id": "1"},
                {"kind": "inflight", "replica": "a", "ids": "12"}):
        with pytest.raises(ValueError, match="not a sync event"):
            event_from_dict(bad)


def test_the_outbox_is_bounded_when_the_bus_is_down() -> None:
    a = make_router()
    s = ReplicaSync("a", max_outbox=3)
    a.add_plugin(s)
    for i in range(5):
        a.route(req(str(i)), 100.0)
    assert len(s.outbox) == 3 and s.dropped == 2


def test_simulated_replicas_that_sync_route_like_one() -> None:
    spec = WorkloadSpec("shared_prefix", rate=20.0, duration=20.0)
    wl = generate(spec, 1)
    one = summarize(Simulator(SimConfig()).run(wl))
    apart = summarize(Simulator(SimConfig(replicas=4)).run(wl))
    synced = summarize(Simulator(SimConfig(replicas=4, sync_delay_s=0.002)).run(wl))
    assert apart["token_hit_rate"] < one["token_hit_rate"] - 0.03
    assert synced["token_hit_rate"] > one["token_hit_rate"] - 0.02


def test_a_joining_replica_catches_up_from_a_snapshot() -> None:
    a, b, sa, sb = pair()
    done = a.route(req("old"), 100.0)
    a.release(done, Outcome(status=200))
    live = a.route(req("new"), 100.0)
    for e in sa.snapshot():
        sb.apply(e, b, 100.0)
    pool = b.pools["default"]
    assert sb.remote_bookings() == 1  # only the request still in flight is booked
    assert pool.workers[live.chosen].inflight == 1
    fp = b.fingerprint(req("other"), pool)
    assert pool.directory.match(fp.hashes, [done.chosen])[done.chosen] > 0
