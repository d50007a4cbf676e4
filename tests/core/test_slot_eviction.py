"""Slot engines (llama.cpp): what a placement overwrites is priced. The directory weighs the
blocks a placement would make homeless by how often recent prompts reused them; the priced
policy counts that prefill for the later requests; the simulated slot engine replaces prompts
the way llama-server does; replay restores the recorded price."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cachepilot.core import InferenceRequest
from cachepilot.core.directory import PrefixDirectory
from cachepilot.core.popularity import BlockPopularity
from cachepilot.core.workers import WorkerMetrics
from cachepilot.sim.engine import EngineConfig, EngineRequest
from cachepilot.sim.llamacpp import LLAMA_ENGINE, LLAMA_WORKLOADS
from cachepilot.sim.measures import summarize
from cachepilot.sim.simulator import SimConfig, Simulator
from cachepilot.sim.slot_engine import SlotEngine, make_engine
from cachepilot.sim.workloads import generate

from helpers.routers import make_router

HOT = list(range(1, 33))  # a 32-block shared document
ONE_OFF = list(range(100, 132))


def one_slot_directory(*workers: str) -> PrefixDirectory:
    d = PrefixDirectory()
    for w in workers:
        d.add_worker(w)
        d.set_slots(w, slots=1, slot_blocks=64)
    return d


def test_popularity_counts_reuse_not_the_holder_and_forgets() -> None:
    p = BlockPopularity(half_life=4.0)
    p.note([1, 2])
    assert p.reuse_probability(1, horizon=2) == 0.0  # one prompt held it: no reuse yet
    for _ in range(3):
        p.note([1, 3])
    assert p.reuse_probability(1, 2) > 0.5 > p.reuse_probability(2, 2) == 0.0
    for i in range(40):
        p.note([1000 + i])
    assert p.reuse_probability(1, 2) < 0.05  # a phase that ended is forgotten


def test_overwriting_the_last_copy_of_a_hot_document_costs_and_a_one_off_does_not() -> None:
    d = one_slot_directory("a", "b")
    for q in range(4):  # the document is asked about four times on a
        d.insert("a", [*HOT, 1000 + q])
    d.insert("b", ONE_OFF)
    new = list(range(200, 240))
    assert d.eviction_blocks("a", new) > 20  # most of the document's 32 blocks, weighted
    assert d.eviction_blocks("b", new) == 0.0  # nobody reuses the one-off
    # Another question on the same document keeps the document: only a tail is lost.
    assert d.eviction_blocks("a", [*HOT, 2000]) < 1.0
    # A copy elsewhere means nothing becomes homeless.
    d.insert("b", [*HOT, 3000])
    assert d.eviction_blocks("a", new) < 1.0


def test_a_paged_engine_has_no_eviction_price() -> None:
    d = PrefixDirectory()
    d.add_worker("a", capacity=64)
    for q in range(4):
        d.insert("a", [*HOT, 1000 + q])
    assert d.eviction_blocks("a", ONE_OFF) == 0.0


def test_priced_puts_a_one_off_where_it_overwrites_nothing_anyone_reuses() -> None:
    r = make_router(workers=("10.0.0.1:8000", "10.0.0.2:8000"))
    pool = r.pools["default"]
    for w in pool.workers:
        pool.update_metrics(w, WorkerMetrics(scraped_at=100.0, slots=1, slot_tokens=4096))
    doc = "a shared handbook chapter about routing " * 60
    hot = []
    for i in range(4):  # one at a time: the document's holder is never busy
        hot.append(r.route(InferenceRequest(model="m", prompt=doc + f"question {i}?"), 100.0))
        r.release(hot[-1], None)
    home = hot[0].chosen
    assert all(d.chosen == home for d in hot)
    other = next(w for w in pool.workers if w != home)
    for i in range(6):  # one-offs: each goes where it overwrites nothing hot
        d = r.route(InferenceRequest(model="m", prompt=f"one-off document {i} " * 200), 100.0)
        by = {c.worker: c for c in d.candidates}
        assert by[home].eviction_ms > 100 * by[other].eviction_ms + 1.0
        assert d.chosen == other
        r.release(d, None)


def test_the_slot_engine_reuses_the_most_similar_idle_slot_else_the_least_recent() -> None:
    e = SlotEngine(replace(EngineConfig(), slots=2, num_blocks=256))
    t = 0.0

    def serve(rid: int, hashes: list[int]) -> EngineRequest:
        nonlocal t
        req = EngineRequest(rid, len(hashes) * 16, tuple(hashes), 2, t)
        e.submit(req)
        while req.finished_at is None:
            res = e.step(t)
            t = res.end
        return req

    assert serve(1, [*HOT, 900]).cached_tokens == 0
    assert serve(2, ONE_OFF).cached_tokens == 0
    assert serve(3, [*HOT, 901]).cached_tokens == 32 * 16  # the document's slot, kept
    assert serve(4, list(range(300, 340))).cached_tokens == 0  # takes the LRU: ONE_OFF's
    assert serve(5, ONE_OFF).cached_tokens == 0
    assert e.cached_prefix_blocks(tuple(HOT)) == 0  # ...which was the document's slot


def test_a_slot_engine_runs_no_more_requests_than_slots() -> None:
    e = make_engine(replace(EngineConfig(), slots=2, num_blocks=256))
    for i in range(5):
        e.submit(EngineRequest(i, 64, (), 50, 0.0))
    e.step(0.0)
    assert (e.running, len(e.waiting)) == (2, 3)
    with pytest.raises(ValueError, match="a slot has 128"):
        e.submit(EngineRequest(9, 4000, (), 10, 0.0))


def test_replay_restores_the_eviction_price_and_decides_alike() -> None:
    from cachepilot.records.replay import Replayer, redecide, replay_policy
    from cachepilot.records.schema import decision_to_record

    spec = LLAMA_WORKLOADS["hotspot"].with_(duration=120.0)
    records: list[dict] = []

    class Records:  # a decision log in memory
        def decision(self, d, pool=None, *, prompt=None) -> None:
            records.append(decision_to_record(d, pool=pool))

        def outcome(self, decision_id, outcome) -> None:
            pass

    # Without a prompt cache (--cache-ram 0): placements overwrite prompts, so some are priced.
    engine = replace(LLAMA_ENGINE, prompt_cache=0)
    sim = Simulator(SimConfig(workers=2, engine=engine), sink=Records())
    summary = summarize(sim.run(generate(spec, 3)))
    assert summary["requests"] == len(records) > 20
    priced = [r for r in records if any(c["eviction_ms"] > 0 for c in r["candidates"])]
    assert priced, "no decision ever priced an eviction"
    replayer = Replayer(replay_policy("priced"))
    for rec in records:
        out = redecide(rec, replayer)
        assert out is not None and out[0].chosen == rec["chosen"], rec["id"]
