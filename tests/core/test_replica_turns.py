"""Replicas take turns on long prompts (core.spread's hold): requests arriving together at
different replicas are routed before any replica hears of the others, so the k-th replica in
their common order waits k bus delays and routes on the placements of those before it,
where that wait is a small share of the request's own prefill. The simulator and the
gateway drive the same rule (the grouped workload's spread with it:
tests/core/test_spread.py)."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from cachepilot.core import InferenceRequest
from cachepilot.core.spread import ReplicaSpread
from cachepilot.core.sync import ReplicaSync
from cachepilot.gateway.director import Pending
from cachepilot.gateway.protocol import DESTINATION_HEADER
from cachepilot.records.explain import turn_line
from cachepilot.records.schema import decision_to_record

from helpers.extproc_msgs import body, headers, set_headers
from helpers.gateway_box import Box
from helpers.routers import EIGHT, make_router, synced_routers

pytestmark = pytest.mark.timeout(30)
LONG = "a long document nobody has sent before " * 2000  # ~20k tokens: a prefill of seconds


def test_the_kth_replica_waits_k_bus_delays_where_that_is_small_beside_the_prefill() -> None:
    s = ReplicaSpread("r2", reach_s=0.006, hold_share=0.03)
    assert s.hold_s(10_000.0, 100.0) == 0.0  # alone: never
    for r in ("r0", "r1", "r3"):
        s.heard(r, 100.0)
    assert s.hold_s(10_000.0, 100.0) == pytest.approx(0.012)  # third in order: 2 x 6 ms
    assert s.hold_s(300.0, 100.0) == 0.0  # 12 ms is more than 3 % of 300 ms
    assert ReplicaSpread("r0", _heard={"r1": 100.0}).hold_s(10_000.0, 100.0) == 0.0  # first


def test_a_later_replica_holds_a_long_prompt_and_then_routes_on_the_earlier_placement() -> None:
    """Two replicas, two idle workers, a long new prompt at each at once: the first routes
    now, the second holds it, and once the first's placement has arrived over the bus it
    goes to the other worker (without the turn, both take the same best one)."""
    r0, r1 = synced_routers(2, EIGHT[:2])
    a = InferenceRequest(model="m", prompt=LONG + "question a")
    b = InferenceRequest(model="m", prompt="other " + LONG + "question b")
    assert r0.replica_hold_s(a, 100.0) == 0.0
    wait = r1.replica_hold_s(b, 100.0)
    assert wait == pytest.approx(r1.spread.reach_s)
    short = InferenceRequest(model="m", prompt="a short question")
    assert r1.replica_hold_s(short, 100.0) == 0.0  # a few ms would matter to it
    first = r0.route(a, 100.0)
    for e in r0.plugins[-1].drain():  # the bus delivers within the wait
        r1.plugins[-1].apply(e, r1, 100.0 + wait / 2)
    assert r1.route(b, 100.0 + wait).chosen != first.chosen


def _box_behind(replica: str = "r1") -> Box:
    """A gateway whose replica comes second, having heard r0."""
    router = make_router(workers=EIGHT[:2])
    sync = ReplicaSync(replica)
    sync.spread.heard("r0", 100.0)
    return Box(router, plugins=(sync,))


async def test_the_gateway_answers_a_held_turn_after_the_wait_in_both_protocols() -> None:
    raw = orjson.dumps({"model": "m", "prompt": LONG})
    box = _box_behind()
    s = box.stream(body_only=True, observe="off", path="/v1/completions")
    out = box.handle(s, body(raw))
    assert isinstance(out, Pending) and s.ex.decision is None
    [resp] = await out.answers()
    assert set_headers(resp)[DESTINATION_HEADER] in EIGHT[:2] and s.ex.decision is not None
    # The turn is explained: in the decision's record and the gateway's metrics.
    rec = decision_to_record(s.ex.decision)
    assert rec["turn_ms"] >= box.router.spread.reach_s * 1000 * 0.9
    assert "held it" in (turn_line(rec) or "")
    assert box.metrics.replica_turns.labels("default")._value.get() == 1
    epp = box.epp()
    assert epp.handle(headers("/v1/completions")) == []
    hit = epp.handle(body(raw))
    assert not isinstance(hit, Pending)  # a hit now: nothing to wait for
    assert box.sink.decisions[-1][0].turn_ms == 0.0
    assert turn_line(decision_to_record(box.sink.decisions[-1][0])) is None
    epp = box.epp()
    assert epp.handle(headers("/v1/completions")) == []
    held = epp.handle(body(orjson.dumps({"model": "m", "prompt": "new " + LONG})))
    assert isinstance(held, Pending)
    first, *_ = await held.answers()
    assert set_headers(first)[DESTINATION_HEADER] in EIGHT[:2]
    assert box.metrics.replica_turns.labels("default")._value.get() == 2
    assert box.metrics.replica_turn_seconds.labels("default")._value.get() > 0.01


async def test_a_client_that_leaves_during_its_turn_is_routed_nowhere() -> None:
    box = _box_behind()
    s = box.stream(body_only=True, observe="off", path="/v1/completions")
    out = box.handle(s, body(orjson.dumps({"model": "m", "prompt": LONG})))
    assert isinstance(out, Pending)
    task = asyncio.ensure_future(out.answers())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    pool = box.router.pools["default"]
    assert s.ex.decision is None and sum(w.inflight for w in pool.workers.values()) == 0
