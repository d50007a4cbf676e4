"""Policies in the simulator: locality vs balance, peer models and the study plumbing."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
from click.testing import CliRunner

from cachepilot.core import Fingerprint, InferenceRequest, Weights
from cachepilot.core.decision import Candidate, Decision
from cachepilot.core.lifecycle import Outcome
from cachepilot.core.policies import LIVE_POLICIES, Context
from cachepilot.core.workers import WorkerMetrics, WorkerSnapshot
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
    VLLMCacheAware,
    VLLMCacheAwareUntokenized,
)


def ctx(tokens=320, seq=0, hashes=None, user_start=0, prefix_key=None):
    fp = None if hashes is None else Fingerprint(tuple(hashes), tokens, 16)
    return Context(seq=seq, tokens=tokens, weights=Weights(), fingerprint=fp,
                   request=InferenceRequest(model="m", user_start=user_start,
                                            prefix_key=prefix_key))


def cand(worker, matched_blocks=0, waiting=0, inflight=0, kv=0.0, queue_ms=0.0,
         metrics=None):
    return Candidate(worker=worker, state=WorkerSnapshot(worker, inflight=inflight,
                                                         metrics=metrics),
                     matched_blocks=matched_blocks, matched_tokens=matched_blocks * 16,
                     waiting=waiting, kv_usage=kv, queue_ms=queue_ms,
                     saved_ms=matched_blocks * 16 * 0.08)


def routed(policy, worker, hashes, tokens=None, cands=None):
    """Tell ``policy`` that a request of ``hashes`` went to ``worker``."""
    d = Decision("x", 0, "p", "m", policy.name, {}, 0, tokens or 16 * len(hashes), 16,
                 tuple(hashes), cands or [cand(worker)], worker, 0, "")
    policy.on_routed(d, None)


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
    if cls not in (PowerOfTwo, VLLMCacheAwareUntokenized):  # the peers blind to caches
        rr = summarize(simulate(shared, SimConfig(policy="round_robin")))
        assert s["token_hit_rate"] > rr["token_hit_rate"]


def test_sglang_follows_the_tree_when_balanced_and_the_load_when_not():
    """sglang-router 0.3.2: a match over 30 % of the request goes to the tree's tenant
    whatever its load (below the balance thresholds); an imbalance, or a low match, goes to
    the first least-loaded worker (PR #14650), not to the smallest tree."""
    p = SGLangCacheAware()
    routed(p, "b", (1, 2, 3, 4))
    routed(p, "c", (5, 6))
    near = ctx(64, hashes=[1, 2, 3, 9])
    cs = [cand("a", inflight=3), cand("b", inflight=10), cand("c", inflight=0)]
    assert p.values(cs, near) == [0.0, 1.0, 0.0]  # 3/4 match > 0.3 → b, despite load
    cs = [cand("a", inflight=3), cand("b", inflight=100), cand("c", inflight=0)]
    assert p.values(cs, near) == [0.0, 0.0, 1.0]  # 100-0 > 64 and 100 > 1.5·0 → least
    # A novel prompt: "b" has the biggest tree and the least load, "a" an empty tree.
    novel = ctx(64, hashes=[7, 8, 9, 10])
    assert p.values([cand("a", inflight=2), cand("b", inflight=1), cand("c", inflight=1)],
                    novel) == [0.0, 1.0, 0.0]  # least loaded, the first of the tied two
    # A low match (1 block of 4 = 25 %) is a low match even though "c" holds it.
    assert p.values([cand("a"), cand("b"), cand("c", inflight=1)],
                    ctx(64, hashes=[5, 11, 12, 13])) == [1.0, 0.0, 0.0]


def test_sglang_returns_the_node_creator_not_a_random_holder():
    """tree.rs: the tenant of a match is the node's ``last_tenant``, the worker that created
    it; a later holder of the same text does not take it over."""
    p = SGLangCacheAware()
    routed(p, "b", (1, 2, 3))
    routed(p, "a", (1, 2, 3))  # a now holds the same text too
    cs = [cand("a"), cand("b")]
    assert all(p.values(cs, ctx(48, seq=s, hashes=[1, 2, 3])) == [0.0, 1.0] for s in range(8))
    routed(p, "a", (1, 2, 3, 4))  # a extends it: the deeper block is a's
    assert p.values(cs, ctx(64, hashes=[1, 2, 3, 4])) == [1.0, 0.0]


def test_vllm_router_matches_per_worker_and_breaks_ties_by_load():
    p = VLLMCacheAware()
    routed(p, "a", (1, 2, 3, 4))
    routed(p, "b", (1, 2, 3, 4))
    req = ctx(64, hashes=[1, 2, 3, 4])
    assert p.values([cand("a", inflight=5), cand("b", inflight=2), cand("c")], req) == [
        0.0, 1.0, 0.0]  # both match fully: the less loaded of the two, not the idle c
    assert p.values([cand("a"), cand("b"), cand("c", inflight=1)],
                    ctx(64, hashes=[1, 9, 9, 9])) == [1.0, 0.0, 0.0]  # 25 %: least loaded


def test_vllm_router_without_worker_tokens_has_no_affinity():
    """In front of llama-server or the sim worker every request is "missing_tokens": the
    first least-loaded worker, whatever it holds."""
    p = VLLMCacheAwareUntokenized()
    routed(p, "a", (1, 2, 3, 4))
    assert p.values([cand("a", inflight=1), cand("b")], ctx(64, hashes=[1, 2, 3, 4])) == [
        0.0, 1.0]
    assert p.values([cand("a"), cand("b")], ctx(64, hashes=[1, 2, 3, 4])) == [1.0, 0.0]


def test_chwbl_is_sticky_and_bounded():
    p = KubeAICHWBL()
    key = ctx(48, hashes=[11, 12, 13], prefix_key=1234)
    even = [cand(w, inflight=2) for w in "abc"]
    first = p.values(even, key).index(1.0)
    assert all(p.values(even, key).index(1.0) == first for _ in range(3))
    loaded = [cand(w, inflight=(20 if i == first else 2)) for i, w in enumerate("abc")]
    v = p.values(loaded, key)
    assert v[first] == 0.0 and sum(v) == 1.0  # over 1.25 × mean: moves on along the ring
    rng = random.Random(7)
    idle = [cand(w) for w in "abc"]
    moved = [p.values(idle, ctx(48, hashes=[1, 2, 3], prefix_key=rng.getrandbits(64))
                      ).index(1.0) for _ in range(12)]
    assert len(set(moved)) > 1  # different first user messages spread over the ring


def test_chwbl_keys_on_the_first_user_message_only():
    """KubeAI's Prefix(): the first 100 characters of the first user message. Two sessions
    with different system prompts and the same opening question share a key; one session's
    later turns keep it."""
    spec = WorkloadSpec("sessions", rate=8.0, duration=60.0)
    wl = generate(spec, 1)
    by_session: dict[str, set] = {}
    for r in wl.requests:
        by_session.setdefault(r.group, set()).add(r.prefix_key)
    assert all(len(keys) == 1 for keys in by_session.values())
    assert len({next(iter(k)) for k in by_session.values()}) == len(by_session)
    from cachepilot.sim.workloads import _Tokens, prefix_key

    toks = _Tokens()
    one = (("sysA", 256), ("q", 40), ("a", 100))
    other = (("sysB", 256), ("q", 40), ("b", 30))
    assert (prefix_key(toks.prompt(one, 3), one, 256)
            == prefix_key(toks.prompt(other, 3), other, 256))
    short = (("sysA", 256), ("q", 10), ("a", 100))  # a 10-token message: only its tokens
    assert prefix_key(toks.prompt(short, 3), short, 256) != prefix_key(
        toks.prompt(one, 3), one, 256)


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


def test_gie_scores_the_raw_scrape_and_its_own_prefix_index():
    """v1.5.0: queue and KV as scraped (not what was sent since), prefix = matched / full
    blocks of the first 256, from the EPP's own index of what it routed."""
    g = GIEDefault()
    paged = WorkerMetrics(waiting=4, kv_usage=0.5, num_blocks=8192)
    routed(g, "a", range(20), cands=[cand("a", metrics=paged)])
    v = g.values([cand("a", waiting=0, metrics=paged),  # Candidate.waiting is ignored
                  cand("b", waiting=9, metrics=WorkerMetrics(waiting=0, kv_usage=0.0))],
                 ctx(320, hashes=range(20)))
    assert v[0] == pytest.approx(2 * 0 + 2 * 0.5 + 3 * 1.0)
    assert v[1] == pytest.approx(2 * 1 + 2 * 1.0 + 3 * 0.0)
    # Only the first 256 blocks count: a cached first half of a 512-block prompt scores a
    # full prefix match.
    g = GIEDefault()
    routed(g, "a", range(256))
    v = g.values([cand("a"), cand("b")], ctx(8192, hashes=range(512)))
    assert v[0] - v[1] == pytest.approx(3.0)
    # Under one full block: no hashes, prefix 0 everywhere.
    assert g.values([cand("a"), cand("b")], ctx(12, hashes=[])) == [4.0, 4.0]
    # llama-server's metrics are not vLLM's: no queue, no KV, prefix alone.
    slots = WorkerMetrics(waiting=5, running=1, slots=1)
    v = g.values([cand("a", metrics=slots), cand("b", metrics=replace(slots, waiting=0))],
                 ctx(4096, hashes=range(256)))
    assert v[0] - v[1] == pytest.approx(3.0)


def test_gie_index_is_an_lru_of_the_engines_size():
    g = GIEDefault()
    small = WorkerMetrics(num_blocks=4)
    routed(g, "a", (1, 2, 3), cands=[cand("a", metrics=small)])
    routed(g, "a", (7, 8, 9), cands=[cand("a", metrics=small)])
    v = g.values([cand("a"), cand("b")], ctx(48, hashes=[1, 2, 3]))
    assert v[0] == v[1]  # 1, 2 evicted: the walk stops at the first block nobody holds


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
    data = seed_claims.run_all(range(2), processes=1)
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
