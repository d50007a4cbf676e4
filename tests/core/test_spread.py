"""Replicas that route at the same moment split near-ties between them (core.spread): each
takes its own share of the equally good workers, so a group of requests arriving together
at different replicas lands on different workers, as one replica would have placed them."""

from __future__ import annotations

from dataclasses import replace

from cachepilot.core import InferenceRequest
from cachepilot.core.spread import ReplicaSpread
from cachepilot.core.sync import ReplicaSync
from cachepilot.lab.replicas import BUS_DELAY_S, replica_workloads
from cachepilot.sim import Simulator, generate
from cachepilot.sim.simulator import REACH_MARGIN_S
from cachepilot.sim.workloads import Dist

from helpers.routers import EIGHT, make_router, synced_routers


def doc(i: int) -> InferenceRequest:
    return InferenceRequest(model="m", prompt=f"document {i} " + "words " * 400)


def test_a_lone_replica_routes_as_before() -> None:
    alone, plain = make_router(workers=EIGHT), make_router(workers=EIGHT)
    alone.add_plugin(ReplicaSync("r0"))  # a sync plugin, but no other replica heard
    for i in range(6):
        assert alone.route(doc(i), 100.0).chosen == plain.route(doc(i), 100.0).chosen


def test_replicas_routing_together_take_different_workers() -> None:
    """Four replicas, two requests each at the same instant, none yet heard of the others'
    placements: eight different workers (without the split, each replica's first pick is
    the same best-valued worker)."""
    rs = synced_routers(4)
    ds = [r.route(doc(10 * k + i), 100.0) for k in range(2) for i, r in enumerate(rs)]
    assert sorted(d.chosen for d in ds) == sorted(EIGHT)
    assert "8 workers within" in ds[0].reason and "split between replicas" in ds[0].reason


def test_a_replica_past_its_share_takes_what_the_others_would_use_last() -> None:
    """Four replicas over eight idle workers own two each. One gets four requests at once,
    the others one each: its third and fourth go to the others' second workers, which they
    would use only for a second request of their own, so the seven land on seven workers."""
    rs = synced_routers(4)
    busy = [rs[0].route(doc(i), 100.0) for i in range(4)]
    alone = [r.route(doc(10 + k), 100.0) for k, r in enumerate(rs[1:])]
    assert len({d.chosen for d in busy + alone}) == 7
    assert all("split between replicas" in d.reason for d in busy)  # not a hash's luck
    s = ReplicaSpread("r0")
    for other in ("r1", "r2", "r3"):
        s.heard(other, 100.0)
    picks = []
    for _ in range(4):  # each pick leaves the near-ties, as a booking does
        i = s.choose(list(EIGHT), [k for k in range(8) if EIGHT[k] not in picks], 100.0)
        picks.append(EIGHT[i])
        s.picked(EIGHT[i], 100.0)
    # r0 owns workers 1 and 5 (address order modulo 4); then r1's and r2's second ones
    assert [p.split(".")[3][0] for p in picks] == ["1", "5", "6", "7"]


def test_a_clear_best_is_not_split() -> None:
    """A cached prefix (prefilled) is worth far more than the tolerance: every replica
    sends its request there."""
    rs = synced_routers(4)
    held = rs[0].route(doc(7), 100.0)
    rs[0].first_token(held, 60.0)
    for e in rs[0].plugins[-1].drain():
        for r in rs[1:]:
            r.plugins[-1].apply(e, r, 100.0)
    for r in rs[1:]:
        assert r.route(doc(7), 100.5).chosen == held.chosen


def test_a_silent_replica_leaves_the_split() -> None:
    s = ReplicaSpread("r1", silent_after_s=5.0)
    s.heard("r0", 100.0)
    assert s.replicas(104.0) == ["r0", "r1"] and s.active(104.0)
    assert s.replicas(105.0) == ["r1"] and not s.active(105.0)
    assert s.choose(list(EIGHT), [0, 1, 2], 105.0) is None


def test_synced_replicas_place_a_group_like_one_replica() -> None:
    """The replicas study's grouped workload, shortened: with the split and the turns on
    long prompts, a group arriving together at four synced replicas is spread over as many
    workers as one replica spreads it (within 0.1 on average), where without them they pile
    up."""
    spec, cfg = replica_workloads(None)["grouped"]
    wl = generate(spec.with_(duration=40.0, together=Dist(6)), 3)

    def spread_of(sim: Simulator) -> float:
        run = sim.run(wl)
        groups: dict[float, set[str]] = {}
        for o in run.results:
            groups.setdefault(o.arrival, set()).add(o.worker)
        return sum(len(g) for g in groups.values()) / len(groups)

    four = replace(cfg, replicas=4, sharing="random", sync_delay_s=BUS_DELAY_S)
    one, synced = spread_of(Simulator(cfg)), spread_of(Simulator(four))
    # Each turn is recorded: the k-th replica's wait, k x the reach (none with one replica).
    reach = BUS_DELAY_S + REACH_MARGIN_S
    turns = [o.turn_s / reach for o in Simulator(four).run(wl).results if o.turn_s > 0]
    assert turns and {round(k) for k in turns} <= {1, 2, 3}
    assert all(abs(k - round(k)) < 1e-6 for k in turns)
    assert not any(o.turn_s for o in Simulator(cfg).run(wl).results)
    off = Simulator(four)
    for rep in off.replicas:
        rep.sync.spread.rel_tolerance = 0.0
        rep.sync.spread.heard = lambda *a: None  # never hears the others: no split, no turns
    unsplit = spread_of(off)
    assert synced >= one - 0.1 and synced > unsplit


def test_together_brings_requests_at_the_same_instant_and_leaves_others_alone() -> None:
    from cachepilot.sim import WorkloadSpec

    base = WorkloadSpec("bursty", duration=20.0)
    assert [r.arrival for r in generate(base, 4).requests] == [
        r.arrival for r in generate(base.with_(together=Dist(1)), 4).requests]
    grouped = generate(base.with_(together=Dist(3)), 4).requests
    times = [r.arrival for r in grouped]
    assert len(times) % 3 == 0 and all(times[i] == times[i + 1] == times[i + 2]
                                       for i in range(0, len(times), 3))
