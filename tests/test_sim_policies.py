"""Policies in the simulator: locality vs balance, peer models and the study plumbing."""

from __future__ import annotations

import json
import random

import pytest
from click.testing import CliRunner

from cachepilot.core import Fingerprint, InferenceRequest, Weights
from cachepilot.core.decision import Candidate, Decision
from cachepilot.core.lifecycle import Outcome
from cachepilot.core.policies import LIVE_POLICIES, Context
from cachepilot.core.workers import WorkerSnapshot
from cachepilot.sim import SimConfig, WorkloadSpec, generate, simulate
from cachepilot.sim.measures import summarize
from cachepilot.sim.peers import (
    PEERS,
    SIM_POLICIES,
    DynamoKV,
    GIEDefault,
    KubeAICHWBL,
    PowerOfTwo,
    SGLangCacheAware,
)


def ctx(tokens=320, seq=0, hashes=None, user_start=0):
    fp = None if hashes is None else Fingerprint(tuple(hashes), tokens, 16)
    return Context(seq=seq, tokens=tokens, weights=Weights(), fingerprint=fp,
                   request=InferenceRequest(model="m", user_start=user_start))


def cand(worker, matched_blocks=0, waiting=0, inflight=0, kv=0.0, queue_ms=0.0):
    return Candidate(worker=worker, state=WorkerSnapshot(worker, inflight=inflight),
                     matched_blocks=matched_blocks, matched_tokens=matched_blocks * 16,
                     waiting=waiting, kv_usage=kv, queue_ms=queue_ms,
                     saved_ms=matched_blocks * 16 * 0.08)


@pytest.fixture(scope="module")
def hotspot():
    return generate(WorkloadSpec("hotspot", duration=20), 2)


@pytest.fixture(scope="module")
def shared():
    return generate(WorkloadSpec("shared_prefix", duration=20, groups=96), 2)


def test_overlap_only_collapses_onto_one_worker_priced_does_not(hotspot):
    ov = summarize(simulate(hotspot, SimConfig(policy="overlap_only")))
    pr = summarize(simulate(hotspot, SimConfig(policy="priced")))
    assert ov["imbalance_assigned"] > 2.5
    assert pr["imbalance_assigned"] < 1.3
    assert ov["ttft_p50_s"] > 5 * pr["ttft_p50_s"]


def test_priced_beats_round_robin_on_shared_prefixes(shared):
    rr = summarize(simulate(shared, SimConfig(policy="round_robin")))
    pr = summarize(simulate(shared, SimConfig(policy="priced")))
    assert pr["token_hit_rate"] > rr["token_hit_rate"] + 0.1
    assert pr["ttft_mean_s"] < 0.7 * rr["ttft_mean_s"]
    assert pr["evictions"] < rr["evictions"]


@pytest.mark.parametrize("cls", PEERS, ids=lambda c: c.name)
def test_peer_policies_complete_every_request_and_use_the_cache(cls, shared):
    assert cls.name in SIM_POLICIES and cls.name not in LIVE_POLICIES
    s = summarize(simulate(shared, SimConfig(policy=cls.name)))
    assert s["completed"] == s["requests"] and s["rejected"] == 0
    assert s["imbalance_assigned"] < 2.0
    if cls is not PowerOfTwo:  # the only peer blind to caches
        rr = summarize(simulate(shared, SimConfig(policy="round_robin")))
        assert s["token_hit_rate"] > rr["token_hit_rate"]


def test_sglang_follows_the_tree_when_balanced_and_the_load_when_not():
    p = SGLangCacheAware()
    d = Decision("x", 0, "p", "m", "sglang", {}, 0, 64, 16, (1, 2, 3, 4), [], "b", 0, "")
    p.on_routed(d, None)
    near = ctx(64, hashes=[1, 2, 3, 9])
    cs = [cand("a", inflight=3), cand("b", inflight=10), cand("c", inflight=0)]
    assert p.values(cs, near) == [0.0, 1.0, 0.0]  # 3/4 match > 0.3 → b, despite load
    cs = [cand("a", inflight=3), cand("b", inflight=100), cand("c", inflight=0)]
    assert p.values(cs, near) == [0.0, 0.0, 1.0]  # 100-0 > 64 and 100 > 1.5·0 → least
    v = p.values([cand("a"), cand("b"), cand("c")], ctx(64, hashes=[7, 8, 9, 10]))
    assert v[1] == 0.0 and v[0] == v[2] == 1.0  # no match: smallest tree (a or c)


def test_chwbl_is_sticky_and_bounded():
    p = KubeAICHWBL()
    key = ctx(48, hashes=[11, 12, 13])
    even = [cand(w, inflight=2) for w in "abc"]
    first = p.values(even, key).index(1.0)
    assert all(p.values(even, key).index(1.0) == first for _ in range(3))
    loaded = [cand(w, inflight=(20 if i == first else 2)) for i, w in enumerate("abc")]
    v = p.values(loaded, key)
    assert v[first] == 0.0 and sum(v) == 1.0  # over 1.25 × mean: moves on along the ring
    # The key is the prefix up to ~25 tokens past where user content starts.
    rng = random.Random(7)
    idle = [cand(w) for w in "abc"]
    moved = [p.values(idle, ctx(48 * 16, hashes=[rng.getrandbits(64) for _ in range(48)])
                      ).index(1.0) for _ in range(12)]
    assert len(set(moved)) > 1  # different prefixes spread over the ring


def test_power_of_two_picks_the_lighter_of_two():
    p = PowerOfTwo()
    cs = [cand("a", inflight=5), cand("b", inflight=1), cand("c", inflight=9)]
    picks: dict[int, int] = {}
    for seq in range(300):
        i = p.values(cs, ctx(seq=seq)).index(1.0)
        picks[i] = picks.get(i, 0) + 1
    assert 2 not in picks  # the heaviest never wins a pair
    assert picks[1] > picks[0]


def test_dynamo_cost_counts_active_blocks_once_and_pending_prefill():
    """cost = prefill tokens / B (uncached + the worker's pending prefill) + distinct active
    blocks ∪ the request's (sequence.rs: a prefix shared by in-flight requests counts once)."""
    d = DynamoKV()
    shared = tuple(range(100, 110))  # a 10-block prefix
    for i in range(3):  # three in-flight requests on a, all sharing it, one own block each
        d.on_routed(Decision(f"x{i}", 0, "p", "m", "dynamo_kv", {}, 0, 176, 16,
                             (*shared, 200 + i), [], "a", 0, ""), None)
    req = ctx(320, hashes=[*shared, *range(300, 310)])  # 20 blocks, the first 10 shared
    a = cand("a", matched_blocks=10)
    a.state = WorkerSnapshot("a", pending_prefill_tokens=160)  # one is still in prefill
    v = d.values([a, cand("b")], req)
    # a: (320 − 160 + 160)/16 = 20 prefill blocks; active 13 distinct + 10 new = 23
    # b: 320/16 = 20 prefill blocks; active 0 + 20 new = 20
    assert v == [pytest.approx(-(20 + 23)), pytest.approx(-(20 + 20))]
    for i in range(3):
        d.on_finish(Decision(f"x{i}", 0, "p", "m", "dynamo_kv", {}, 0, 176, 16,
                             (*shared, 200 + i), [], "a", 0, ""), Outcome())
    assert d.values([cand("a", matched_blocks=10)], req) == [pytest.approx(-(10 + 20))]


def test_gie_scores_and_its_prefix_window():
    g = GIEDefault()
    v = g.values([cand("a", matched_blocks=20, waiting=4, kv=0.5),
                  cand("b", waiting=0, kv=0.0)], ctx(320))
    assert v[0] == pytest.approx(2 * 0 + 2 * 0.5 + 3 * 1.0)
    assert v[1] == pytest.approx(2 * 1 + 2 * 1.0 + 3 * 0.0)
    # Only the first 256 blocks (4,096 tokens) count: a cached first half of an 8k prompt
    # scores a full prefix match.
    v = g.values([cand("a", matched_blocks=256), cand("b")], ctx(8192))
    assert v[0] - v[1] == pytest.approx(3.0)


def test_chwbl_bound_is_upstreams():
    """loadOK = load ≤ factor × (total + 1) / n (balance_chwbl.go): with 4 workers and 8 in
    flight, the bound is 2.81, so the ring's owner keeps the request at a load of 2."""
    p = KubeAICHWBL()
    key = ctx(48, hashes=[11, 12, 13])
    idle = [cand(w) for w in "abcd"]
    owner = p.values(idle, key).index(1.0)
    assert p.values([cand(w, inflight=2) for w in "abcd"], key).index(1.0) == owner


def test_simulate_cli_json():
    from cachepilot.cli.sim import simulate_cmd

    res = CliRunner().invoke(simulate_cmd, ["--policy", "kubeai_chwbl", "--workload", "hotspot",
                                            "--duration", "5", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["completed"] == data["requests"] > 50
    bad = CliRunner().invoke(simulate_cmd, ["--policy", "nope"])
    assert bad.exit_code != 0 and "nope" in bad.output and "priced" in bad.output


def test_claims_are_computed_from_the_runs(monkeypatch, tmp_path):
    """A two-seed study on shortened workloads produces every claim from measured values."""
    from cachepilot.lab import seed_claims
    from cachepilot.lab.output import StudyOutput
    from cachepilot.lab.seed_claims import runs

    short = {k: v.with_(duration=v.duration / 6) for k, v in runs.WORKLOADS.items()}
    monkeypatch.setattr(runs, "WORKLOADS", short)
    data = seed_claims.run_all(2, processes=1)
    claims, doc = seed_claims.write_outputs(data, StudyOutput(tmp_path, "cachepilot experiment"))
    assert doc["setup"]["workloads"]["shared"]["duration"] == short["shared"].duration
    ids = {c.id for c in claims}
    assert {"1a", "1b", "1c", "2a", "2b", "3", "4", "5-bursty", "5-hotspot"} <= ids
    two_a = next(c for c in claims if c.id == "2a")
    assert len(two_a.values) == 2 and two_a.stats["mean"] > 2.5
    report = (tmp_path / "report.md").read_text()
    for c in claims:  # every claim has its row in the report's table
        assert any(line.startswith(f"| {c.id} |") for line in report.splitlines()), c.id
    for f in ("results.json", "weight_sweep.png", "imbalance.png", "ttft_hotspot.png",
              "seed_vs_weight.png"):
        assert (tmp_path / f).stat().st_size > 1000
