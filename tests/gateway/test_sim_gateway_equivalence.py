"""The three drivers of the routing core decide alike: the simulator, the live gateway and
replay of the gateway's decision log.

The simulator drives the core directly; the gateway reaches it through Envoy's ext_proc
messages (JSON body → token fingerprint → route → destination header); replay rebuilds the
router's inputs from the log and calls the same ``Router.decide``. Record what the simulator
fed the core, feed the same requests (as OpenAI bodies with token-id prompts), metric
snapshots and clock to the gateway's director and Envoy streams with a decision log, then
replay that log. Run it under the default pricing and under a changed one: all three move
together, because there is one pricing.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from cachepilot.core import Pool, Router
from cachepilot.core import router as router_module
from cachepilot.gateway.director import Director
from cachepilot.gateway.envoy_streams import EnvoyStreams, RoutingStream
from cachepilot.gateway.protocol import DESTINATION_HEADER
from cachepilot.records import Recorder, open_log
from cachepilot.records.plugins import lifecycle_plugins
from cachepilot.records.replay import replay
from cachepilot.sim import SimConfig, Simulator, WorkloadSpec, generate
from cachepilot.sim.workloads import MODEL, _Tokens

from helpers.extproc_msgs import body, headers, set_headers
from helpers.sim_calls import record_core_calls

WORKLOAD = generate(WorkloadSpec("hotspot", duration=6.0), 3)
_queue_ms = router_module.queue_ms


Choices = dict[str, str]  # decision id → chosen worker


def run_three_drivers(log: Path) -> tuple[Choices, Choices, Choices]:
    """Each driver's choices: simulator, gateway, replay of the gateway's log."""
    sim = Simulator(SimConfig(policy="priced"))
    calls = record_core_calls(sim)
    sim.run(WORKLOAD)
    sim_choices = {c[3].id: c[3].chosen for c in calls if c[0] == "route"}

    tokens = _Tokens()
    prompts = {f"r{r.id}": [int(t) for t in tokens.prompt(r.segments, 0)]
               for r in WORKLOAD.requests}
    pool = Pool(sim.pool.spec)
    for addr in sim.pool.workers:
        pool.upsert_worker(addr)
    clock = [0.0]
    routed_at: dict[str, float] = {}
    gateway_choices: Choices = {}
    with Recorder(log) as sink:
        # The gateway's plugins from the same factory as the simulator's: it learns each
        # worker's TTFT model from streamed first tokens, as the simulator does from its
        # engines', and records every decision.
        gateway_router = Router([pool], plugins=lifecycle_plugins(sink=sink).plugins)
        proc = EnvoyStreams(Director(gateway_router, clock=lambda: clock[0]))
        exchanges: dict[str, RoutingStream] = {}
        for call in calls:
            if call[0] == "metrics":
                pool.update_metrics(call[1], call[2])
            elif call[0] == "route":
                _, _, now, d = call
                clock[0] = routed_at[d.id] = now
                gateway_router.next_id = lambda did=d.id: did  # same id → same tie-break
                raw = orjson.dumps({"model": MODEL, "prompt": prompts[d.id], "max_tokens": 16,
                                    "stream": True})
                ex = exchanges[d.id] = RoutingStream()
                assert proc.handle(ex, headers("/v1/completions",
                                               content_length=str(len(raw)))) == []
                out = proc.handle(ex, body(raw))
                gateway_choices[d.id] = set_headers(out[0])[DESTINATION_HEADER]
                assert [c.value for c in ex.ex.decision.candidates] == \
                    pytest.approx([c.value for c in d.candidates], rel=1e-9)
            elif call[0] == "first":  # the first streamed chunk, when the engine made it
                _, did, ttft_ms = call
                clock[0] = routed_at[did] + ttft_ms / 1000.0
                proc.handle(exchanges[did], headers("", response=True))
                proc.handle(exchanges[did], body(b"data: {}\n\n", eos=False, response=True))
            else:
                proc.handle(exchanges[call[1]], body(b"{}", eos=True, response=True))
    assert all(w.inflight == 0 for w in pool.workers.values())

    reader = open_log(log)
    try:
        recs = list(reader)
    finally:
        reader.close()
    report = replay(recs, keep_changes=len(recs))
    assert report.replayed == len(recs) == len(gateway_choices)
    changed = {c.id: c.chosen for c in report.changes}
    replay_choices = {r["id"]: changed.get(r["id"], r["chosen"]) for r in recs}
    return sim_choices, gateway_choices, replay_choices


def test_gateway_and_simulator_choose_the_same_workers(tmp_path: Path) -> None:
    sim, gateway, replayed = run_three_drivers(tmp_path / "log")
    assert len(sim) == len(WORKLOAD.requests) > 50
    assert gateway == sim
    assert replayed == gateway


def test_a_pricing_change_moves_all_three_drivers_alike(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    default = run_three_drivers(tmp_path / "default")
    # Queues cost ten times what the model says: the router spills hot prefixes sooner.
    monkeypatch.setattr(router_module, "queue_ms", lambda *a: 10.0 * _queue_ms(*a))
    sim, gateway, replayed = run_three_drivers(tmp_path / "changed")
    assert sim != default[0], "the changed pricing must change some decisions"
    assert gateway == sim and replayed == gateway
    # Replay of the log recorded under the default pricing re-prices it with the changed one.
    reader = open_log(tmp_path / "default")
    try:
        assert replay(list(reader)).changed > 0
    finally:
        reader.close()
