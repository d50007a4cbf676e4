"""The simulator: event order, reproducibility, workload shapes, the Router equivalence."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from cachepilot.core import InferenceRequest, Pool, PoolSpec, Router
from cachepilot.core.lifecycle import FIRST_TOKEN, Plugin
from cachepilot.core.predictor import TTFTPredictor
from cachepilot.sim import SimConfig, Simulator, WorkloadSpec, generate, ideal_ttfts, simulate
from cachepilot.sim.engine import EngineConfig
from cachepilot.sim.measures import summarize
from cachepilot.sim.workloads import MODEL, read_trace, write_trace

from helpers.sim_calls import record_core_calls

SHORT = 15.0


def wl(kind: str, seed: int = 1, **kw):
    return generate(WorkloadSpec(kind, duration=kw.pop("duration", SHORT), **kw), seed)


class Finished(Plugin):
    def __init__(self) -> None:
        self.seen: list = []

    def on_finish(self, decision, outcome) -> None:
        self.seen.append((decision, outcome))


def test_events_in_time_order_and_outcomes_consistent():
    finished = Finished()
    w = wl("shared_prefix")
    run = simulate(w, SimConfig(policy="priced"), plugins=[finished])
    assert len(finished.seen) == len(w) == len(run.results)
    finishes = [o.completed_at for _, o in finished.seen]
    assert finishes == sorted(finishes)  # the lifecycle ends in virtual-time order
    results = {f"r{r.request_id}": r for r in run.results}
    step = EngineConfig().step_ms / 1000
    for d, outcome in finished.seen:
        o = results[d.id]
        assert d.chosen == o.worker and outcome.completed_at == o.finished_at
        assert outcome.ttft_ms == pytest.approx(o.ttft_s * 1000.0)
        assert outcome.cached_tokens == o.cached_tokens
        assert outcome.ttft_kind == FIRST_TOKEN and outcome.status == 200
        assert o.first_token_at >= o.arrival + step - 1e-9
        assert o.finished_at >= o.first_token_at
        assert o.ttft_s == pytest.approx(o.first_token_at - o.arrival)
        assert 0 <= o.cached_tokens < o.prompt_tokens


def test_same_seed_same_result_other_seed_differs():
    a = summarize(simulate(wl("hotspot", 3), SimConfig(policy="priced")))
    b = summarize(simulate(wl("hotspot", 3), SimConfig(policy="priced")))
    c = summarize(simulate(wl("hotspot", 4), SimConfig(policy="priced")))
    for k in ("ttft_p50_s", "ttft_p99_s", "token_hit_rate", "evictions", "imbalance_assigned"):
        assert a[k] == b[k]
    assert (a["ttft_p50_s"], a["requests"]) != (c["ttft_p50_s"], c["requests"])


def test_shared_prefix_shape():
    w = wl("shared_prefix", groups=8)
    assert abs(len(w) / SHORT - 20) < 4
    by_group: dict[str, list] = {}
    for r in w.requests:
        by_group.setdefault(r.group, []).append(r)
    assert len(by_group) <= 8
    for reqs in by_group.values():
        if len(reqs) > 1:
            a, b = reqs[0].fp.hashes, reqs[1].fp.hashes
            common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
            assert common * 16 >= 512  # the shared document, at least the clip minimum
    firsts = {r.fp.hashes[0] for r in w.requests}
    assert len(firsts) == len(by_group)  # different groups share nothing


def test_hotspot_shape_is_skewed_and_shares_the_system_prompt():
    w = wl("hotspot", duration=30)
    assert len({r.fp.hashes[0] for r in w.requests}) == 1  # one system prompt for all
    counts = Counter(r.group for r in w.requests)
    top = counts.most_common(1)[0][1] / len(w)
    assert top > 3 / 16  # Zipf: the top document far above a uniform share


def test_bursty_is_overdispersed():
    w = wl("bursty", duration=60)
    t = np.array([r.arrival for r in w.requests])
    counts = np.histogram(t, bins=np.arange(0, 61, 1.0))[0]
    assert counts.var() / counts.mean() > 3  # Poisson would give ≈ 1
    p = wl("shared_prefix", duration=60)
    pc = np.histogram([r.arrival for r in p.requests], bins=np.arange(0, 61, 1.0))[0]
    assert pc.var() / pc.mean() < 2


def test_sessions_grow_their_own_prefix():
    w = wl("sessions", duration=30)
    sessions: dict[str, list] = {}
    for r in w.requests:
        sessions.setdefault(r.group, []).append(r)
    multi = [s for s in sessions.values() if len(s) > 1]
    assert multi
    for s in multi:
        s.sort(key=lambda r: r.extra["turn"])
        for prev, nxt in itertools.pairwise(s):
            assert nxt.arrival >= prev.arrival
            assert nxt.prompt_tokens > prev.prompt_tokens
            assert nxt.fp.hashes[:len(prev.fp.hashes)] == prev.fp.hashes


def test_trace_round_trip(tmp_path):
    w = wl("hotspot", duration=5)
    path = tmp_path / "t.jsonl"
    write_trace(w.requests, path)
    back = list(read_trace(path))
    assert [r.fp.hashes for r in back] == [r.fp.hashes for r in w.requests]
    assert [r.arrival for r in back] == [r.arrival for r in w.requests]
    assert [r.max_tokens for r in back] == [r.max_tokens for r in w.requests]
    # token ids work too, and replaying through the simulator completes every request
    with open(path, "a") as f:
        f.write('{"t": 100.0, "token_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,'
                ' 16, 17], "max_tokens": 4}\n')
    spec = WorkloadSpec("trace", path=str(path))
    run = simulate(generate(spec, 0), SimConfig())
    assert all(o.finished_at is not None for o in run.results)
    assert len(run.results) == len(w) + 1


def test_ideal_bound_is_below_every_policy():
    w = wl("shared_prefix")
    ideal = ideal_ttfts(w)
    assert ideal.min() >= EngineConfig().step_ms / 1000
    for p in ("round_robin", "priced"):
        s = summarize(simulate(w, SimConfig(policy=p)), ideal)
        assert s["p50_over_ideal"] >= 1.0


def test_stale_metrics_make_workers_ineligible():
    """A scrape interval beyond stale_after_s leaves the router without fresh metrics:
    requests are rejected (429), as the gateway would answer."""
    w = wl("shared_prefix", duration=20)
    run = simulate(w, SimConfig(scrape_interval_s=8.0))
    rejected = [o for o in run.results if o.rejected]
    assert rejected and all(o.rejected == "overloaded" for o in rejected)
    fresh = simulate(w, SimConfig(scrape_interval_s=0.0))
    assert not any(o.rejected for o in fresh.results)


def test_simulator_and_direct_router_choose_the_same_worker():
    """Record every call the simulator makes into the routing core (metric snapshots,
    route, first_token, release) and replay them on a fresh Router: same choices, same
    priced terms. The simulator adds no routing logic of its own."""
    w = wl("hotspot", duration=10)
    cfg = SimConfig(policy="priced")
    sim = Simulator(cfg)
    calls = record_core_calls(sim)
    pool = sim.pool
    sim.run(w)
    assert sum(1 for c in calls if c[0] == "route") == len(w)

    pool2 = Pool(pool.spec)
    for addr in pool.workers:
        pool2.upsert_worker(addr)
    router2 = Router([pool2], id_prefix="replay", plugins=[TTFTPredictor()])
    mine: dict[str, object] = {}
    for c in calls:
        if c[0] == "metrics":
            pool2.update_metrics(c[1], c[2])
        elif c[0] == "route":
            _, req, now, d = c
            did = d.id
            d2 = router2.route(InferenceRequest(model=MODEL, max_tokens=req.max_tokens,
                                                token_ids=None, fingerprint=req.fingerprint,
                                                user_start=req.user_start),
                               now, did)
            assert d2.chosen == d.chosen
            assert [x.value for x in d2.candidates] == [x.value for x in d.candidates]
            mine[did] = d2
        elif c[0] == "first":
            router2.first_token(mine[c[1]], c[2])
        else:
            router2.release(mine[c[1]], c[2])


def test_router_prices_a_fingerprint_built_from_token_ids_like_the_simulator():
    """The simulator's Fingerprint equals the one the gateway computes from token ids."""
    w = wl("shared_prefix", duration=2)
    from cachepilot.sim.workloads import _Tokens

    r = w.requests[0]
    ids = _Tokens().prompt(r.segments, 0)
    spec = PoolSpec(name="p", models=(MODEL,))
    router = Router([Pool(spec)])
    fp = router.fingerprint(InferenceRequest(model=MODEL, token_ids=tuple(int(x) for x in ids)),
                            router.pools["p"])
    assert fp == r.fp


def test_simulate_takes_cost_overrides_from_the_command_line() -> None:
    """``--cost`` reaches the simulated router: an admission limit of 0 turns every request
    away (429), as the gateway would."""
    import json

    from click.testing import CliRunner

    from cachepilot.cli import main

    args = ["simulate", "--duration", "2", "--json"]
    base = json.loads(CliRunner().invoke(main, args).output)
    shut = json.loads(CliRunner().invoke(main, [*args, "--cost", "admission_limit=0"]).output)
    assert base["rejected"] == 0 < shut["requests"] == shut["rejected"]
