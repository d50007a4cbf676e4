"""The simulator and the live gateway make the same decision on the same inputs.

The simulator drives the routing core directly; the gateway reaches it through Envoy's
ext_proc messages (JSON body → token fingerprint → route → destination header). Record what
the simulator fed the core, then feed the same requests (as OpenAI bodies with token-id
prompts), the same metric snapshots and the same clock to the gateway's Processor.
"""

from __future__ import annotations

import orjson

from cachepilot.core import Pool, Router
from cachepilot.gateway.service import DESTINATION_HEADER, Exchange, Processor
from cachepilot.sim import SimConfig, Simulator, WorkloadSpec, generate
from cachepilot.sim.workloads import MODEL, _Tokens

from extproc_msgs import body, headers, set_headers
from sim_calls import record_core_calls


def test_gateway_and_simulator_choose_the_same_workers() -> None:
    workload = generate(WorkloadSpec("hotspot", duration=6.0), 3)
    sim = Simulator(SimConfig(policy="priced"))
    calls = record_core_calls(sim)
    pool = sim.pool
    sim.run(workload)

    tokens = _Tokens()
    prompts = {f"r{r.id}": [int(t) for t in tokens.prompt(r.segments, 0)]
               for r in workload.requests}
    pool2 = Pool(pool.spec)
    for addr in pool.workers:
        pool2.upsert_worker(addr)
    gateway_router = Router([pool2])
    clock = [0.0]
    proc = Processor(gateway_router, clock=lambda: clock[0])
    exchanges: dict[str, Exchange] = {}
    routed = 0
    for call in calls:
        if call[0] == "metrics":
            pool2.update_metrics(call[1], call[2])
        elif call[0] == "route":
            _, _, now, d = call
            clock[0] = now
            gateway_router.next_id = lambda did=d.id: did  # same id → same tie-break
            raw = orjson.dumps({"model": MODEL, "prompt": prompts[d.id],
                                "max_tokens": 16})
            ex = exchanges[d.id] = Exchange()
            assert proc.handle(ex, headers("/v1/completions",
                                           content_length=str(len(raw)))) == []
            out = proc.handle(ex, body(raw))
            assert set_headers(out[0])[DESTINATION_HEADER] == d.chosen
            assert [c.value for c in ex.decision.candidates] == [c.value for c in d.candidates]
            routed += 1
        elif call[0] == "first":  # a non-streamed answer's headers are its first token
            proc.handle(exchanges[call[1]], headers("", response=True))
        else:
            proc.handle(exchanges[call[1]], body(b"{}", eos=True, response=True))
    assert routed == len(workload.requests) > 50
    assert all(w.inflight == 0 for w in pool2.workers.values())
