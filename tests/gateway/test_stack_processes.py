"""`cachepilot gateway --processes 2` behind Envoy (the local stack's ``processes``): the
processes share the routing, each request is observed by the process that routed it, and
they route a shared prefix as one gateway would."""

from __future__ import annotations

import json

import httpx
import pytest

from cachepilot.tooling.procs import http_get
from cachepilot.tooling.stack import LocalStack, StackConfig

from helpers.delivery import delivered, quiet
from helpers.polling import until
from helpers.tools import have_envoy

pytestmark = pytest.mark.skipif(not have_envoy(), reason="no envoy binary")


def status(stack: LocalStack, path: str) -> list:  # type: ignore[type-arg]
    return [json.loads(http_get(f"http://127.0.0.1:{stack.admin_port + i}{path}")[1])
            for i in range(stack.config.processes)]


def settle(stack: LocalStack, timeout_s: float = 10.0) -> list[list[dict]]:
    """Until nothing is in flight in any process (every observation and end delivered)."""
    def idle() -> list[list[dict]]:
        workers = status(stack, "/workers")
        assert all(w["inflight"] == 0 for ws in workers for w in ws), workers
        return workers
    return until(idle, timeout_s, "nothing in flight", interval=0.05, retry_on=(AssertionError,))


def event_counts(stack: LocalStack) -> list[tuple[int, int]]:
    """Each process's (events sent, events received from the others)."""
    return [(p["sent_events"], p["received_events"]) for p in status(stack, "/replicas")]


def test_two_processes_route_as_one() -> None:
    stack = LocalStack(StackConfig(workers=3, speed=50.0, processes=2)).start(timeout_s=90)
    try:
        with httpx.Client(timeout=30) as client:
            until(lambda: all(r["connected_peers"] for r in status(stack, "/replicas")), 10,
                  "the processes connecting", interval=0.1)
            by_process: dict[str, int] = {}
            chosen = set()
            for i in range(12):
                before = quiet(lambda: event_counts(stack))
                r = client.post(f"{stack.url}/v1/completions", json={
                    "model": stack.config.model, "max_tokens": 2,
                    "prompt": "a long shared document " * 300 + f"question {i}"})
                assert r.status_code == 200, r.text
                owner = r.headers["x-cachepilot-decision-id"].split(".")[0]
                by_process[owner] = by_process.get(owner, 0) + 1
                chosen.add(r.headers["x-cachepilot-worker"])
                # The other process hears of the placement.
                delivered(lambda: event_counts(stack), before, what="the other process hearing")
            assert set(by_process) == {"p0", "p1"}  # Envoy spread the routing streams
            assert len(chosen) == 1  # one prefix, one worker, whichever process routed it
        settle(stack)  # each process released its own requests: the observation came back
        peers = status(stack, "/replicas")
        assert all(p["bad"] == 0 and p["received_events"] > 0 for p in peers)
    finally:
        stack.stop()
