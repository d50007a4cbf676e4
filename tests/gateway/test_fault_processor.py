"""Failure handling in the gateway, without a network: what counts as a first token, passive
detection of a dead or stalled worker, the fallback list Envoy's retries walk, and readiness
in the pool (issue 11)."""

from __future__ import annotations

import orjson
import pytest

from cachepilot.core import WorkerMetrics
from cachepilot.core.lifecycle import Plugin
from cachepilot.gateway.envoy_streams import RoutingStream
from cachepilot.gateway.protocol import (
    DESTINATION_HEADER,
    ERROR_HEADER,
    LB_METADATA_NAMESPACE,
    WORKER_HEADER,
)

from helpers.extproc_msgs import body, headers
from helpers.gateway_box import Box
from helpers.routers import WORKERS, make_router


class FirstTokens(Plugin):
    def __init__(self) -> None:
        self.seen: list[float | None] = []

    def on_first_token(self, decision, ttft_ms) -> None:
        self.seen.append(ttft_ms)


@pytest.fixture
def proc() -> Box:
    now = [100.0]
    first_tokens = FirstTokens()
    p = Box(clock=lambda: now[0], plugins=[first_tokens])
    p.now = now  # type: ignore[attr-defined]
    p.first_tokens = first_tokens  # type: ignore[attr-defined]
    return p


def route(proc: Box, stream: bool = True) -> tuple[RoutingStream, list]:
    raw = orjson.dumps({"model": "m", "stream": stream,
                        "messages": [{"role": "user", "content": "hello " * 50}]})
    s = RoutingStream()
    assert proc.handle(s, headers("/v1/chat/completions", content_length=str(len(raw)))) == []
    return s, proc.handle(s, body(raw))


def test_the_fallback_list_is_the_chosen_worker_then_the_runner_ups(proc) -> None:
    s, out = route(proc)
    md = out[0].dynamic_metadata.fields[LB_METADATA_NAMESPACE].struct_value
    order = md.fields[DESTINATION_HEADER].string_value.split(",")
    assert order[0] == s.ex.decision.chosen and sorted(order) == sorted(WORKERS)
    values = {c.worker: c.value for c in s.ex.decision.candidates}
    assert values[order[1]] >= values[order[2]]


def test_an_envoy_error_is_not_a_first_token_and_marks_an_unreachable_worker_down(proc) -> None:
    s, _ = route(proc)
    chosen = s.ex.decision.chosen
    proc.handle(s, headers("", response=True, status="503",
                            **{WORKER_HEADER: chosen, ERROR_HEADER: "worker_unreachable"}))
    proc.handle(s, body(b'{"error":{"message":"worker unreachable"}}', response=True))
    assert proc.first_tokens.seen == []  # type: ignore[attr-defined]
    w = proc.router.pools["default"].workers[chosen]
    assert not w.ready and "connect" in w.down
    assert w.inflight == 0 and w.pending_prefill_tokens == 0
    # The next scrape that works brings it back.
    proc.router.pools["default"].update_metrics(chosen, WorkerMetrics(scraped_at=100.0))
    assert w.ready and not w.down


def test_an_answer_from_the_runner_up_is_not_the_chosen_workers_first_token(proc) -> None:
    s, _ = route(proc)
    chosen = s.ex.decision.chosen
    other = next(w for w in WORKERS if w != chosen)
    proc.handle(s, headers("", response=True, **{WORKER_HEADER: other}))
    proc.handle(s, body(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n', eos=True,
                         response=True))
    assert proc.first_tokens.seen == []  # type: ignore[attr-defined]
    assert "connect" in proc.router.pools["default"].workers[chosen].down


def test_a_worker_error_is_not_a_first_token_but_a_2xx_is(proc) -> None:
    s, _ = route(proc)
    proc.handle(s, headers("", response=True, status="500",
                            **{WORKER_HEADER: s.ex.decision.chosen}))
    proc.handle(s, body(b'{"error":"boom"}', response=True))
    assert proc.first_tokens.seen == []  # type: ignore[attr-defined]
    s, _ = route(proc)
    proc.handle(s, headers("", response=True, **{WORKER_HEADER: s.ex.decision.chosen}))
    proc.handle(s, body(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n', eos=True,
                         response=True))
    assert len(proc.first_tokens.seen) == 1  # type: ignore[attr-defined]


def test_a_worker_whose_requests_get_no_first_byte_is_stalled(proc) -> None:
    s, _ = route(proc)
    chosen = s.ex.decision.chosen
    assert proc.stalls.stalled(105.0, after_s=10.0) == {}
    why = proc.stalls.stalled(111.0, after_s=10.0)
    assert list(why) == [chosen] and "no first byte for 11.0s" in why[chosen]
    proc.now[0] = 111.0  # type: ignore[attr-defined]
    proc.handle(s, headers("", response=True, **{WORKER_HEADER: chosen}))
    assert proc.stalls.stalled(112.0, after_s=10.0) == {}


def test_no_ready_worker_names_the_reasons_and_says_when_to_retry(proc) -> None:
    pool = proc.router.pools["default"]
    for w in WORKERS:
        pool.update_metrics(w, None, error="ClientConnectorError: refused")
    _, out = route(proc)
    imm = out[0].immediate_response
    assert imm.status.code == 503
    message = orjson.loads(imm.body)["error"]["message"]
    assert "refused" in message and WORKERS[0] in message
    assert {h.header.key: h.header.raw_value for h in imm.headers.set_headers}[
        "retry-after"] == b"1"


def test_declared_readiness_and_being_down_combine() -> None:
    pool = make_router().pools["default"]
    a = WORKERS[0]
    pool.set_down(a, "stalled", "stalled: no first byte")
    pool.set_ready(a, True)
    assert not pool.workers[a].ready  # declared ready, but down
    pool.set_down(a, "stalled", None)
    assert pool.workers[a].ready
    pool.set_ready(a, False)
    pool.update_metrics(a, WorkerMetrics(scraped_at=1.0))
    assert not pool.workers[a].ready  # a good scrape does not override the pod's readiness


def test_a_restarted_engine_starts_with_an_empty_directory() -> None:
    router = make_router()
    pool = router.pools["default"]
    a = WORKERS[0]
    pool.update_metrics(a, WorkerMetrics(scraped_at=1.0, prefix_queries=5000.0))
    pool.directory.insert(a, (1, 2, 3))
    assert pool.directory.match((1, 2, 3), pool.workers).get(a) == 3
    pool.update_metrics(a, WorkerMetrics(scraped_at=2.0, prefix_queries=10.0))
    assert not pool.directory.match((1, 2, 3), pool.workers).get(a)
