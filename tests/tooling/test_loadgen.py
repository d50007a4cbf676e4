"""The load generator sends simulator workloads as text and summarises them with the
simulator's keys and units."""

from __future__ import annotations

import math

from aiohttp.test_utils import TestServer

from cachepilot.sim import SimConfig, Simulator, generate
from cachepilot.sim.measures import summarize as sim_summarize
from cachepilot.sim.workloads import WORDS, segment_text
from cachepilot.tooling import demo
from cachepilot.tooling.loadgen import Result, chat_body, run, summarize
from cachepilot.tooling.sim_worker import WorkerConfig, make_app

SHARED_KEYS = {"requests", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_mean_s",
               "throughput_rps", "token_hit_rate", "imbalance"}


def test_segment_text_is_a_function_of_its_key() -> None:
    a, b = segment_text("k1", 100), segment_text("k1", 100)
    assert a == b and len(a) == 400 and segment_text("k2", 100) != a
    assert set(a.split()) <= set(WORDS)
    assert segment_text("k1", 50) == a[:200]  # a shorter segment is a prefix of the longer


def test_demo_requests_share_their_group_prompt() -> None:
    reqs = demo.requests(demo.WORKLOAD.with_(duration=5.0))
    assert reqs and all(r.max_tokens == 32 for r in reqs)
    by_group: dict[str, set[str]] = {}
    for r in reqs:
        system = chat_body(r, demo.MODEL)["messages"][0]["content"]
        assert len(system) == 4000 * 4
        by_group.setdefault(r.group, set()).add(system)
    assert all(len(v) == 1 for v in by_group.values())
    assert len({next(iter(v)) for v in by_group.values()}) == len(by_group)


def test_p_unique_keeps_the_shared_draws() -> None:
    spec = demo.WORKLOAD.with_(duration=10.0)
    base = generate(spec, 3).requests
    mixed = generate(spec.with_(p_unique=0.3), 3).requests
    assert [r.arrival for r in base] == [r.arrival for r in mixed]
    unique = [m for m in mixed if m.group.startswith("u")]
    assert 0 < len(unique) < len(mixed)
    for b, m in zip(base, mixed, strict=True):
        if not m.group.startswith("u"):
            assert b.fp.hashes == m.fp.hashes


def test_summary_has_the_simulators_keys_and_units() -> None:
    results = [Result(ok=True, status=200, ttft_s=t, worker=w, decision_id="d",
                      prompt_tokens=100, cached_tokens=c)
               for t, w, c in ((0.1, "a", 0), (0.2, "a", 50), (0.3, "b", 100))]
    results.append(Result(ok=False, status=503, error="no worker"))
    s = summarize(results, 2.0)
    assert set(s) >= SHARED_KEYS
    assert (s["requests"], s["errors"]) == (4, 1)
    assert s["ttft_p50_s"] == 0.2 and s["token_hit_rate"] == 0.5
    assert s["imbalance"] == round(2 / 1.5, 3) and s["throughput_rps"] == 1.5
    wl = generate(demo.WORKLOAD.with_(duration=2.0, groups=4, prefix=demo.WORKLOAD.prefix), 0)
    sim = sim_summarize(Simulator(SimConfig(workers=2)).run(wl))
    assert set(sim) >= SHARED_KEYS
    assert math.isclose(sim["imbalance"], sim["imbalance_assigned"])


async def test_run_sends_generated_requests_to_a_worker() -> None:
    server = TestServer(make_app(WorkerConfig(speed=50.0)))
    await server.start_server()
    try:
        reqs = demo.requests(demo.WORKLOAD.with_(duration=1.0, rate=10.0, groups=2))
        bodies = [chat_body(r, WorkerConfig().model) for r in reqs]
        url = str(server.make_url("")).rstrip("/")
        results, wall = await run(url, [r.arrival for r in reqs], bodies)
    finally:
        await server.close()
    assert len(results) == len(reqs) and all(r.ok for r in results), results[:2]
    s = summarize(results, wall)
    assert s["errors"] == 0 and s["ttft_p50_s"] > 0
    assert s["token_hit_rate"] > 0  # the second request of a group hits its prefix
