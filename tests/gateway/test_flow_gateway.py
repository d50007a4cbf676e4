"""Flow control in the gateway, without gRPC: both protocols hold the stream and answer once
the request is dispatched or refused; a client that leaves takes it out of the queue; the
decision record and `cachepilot explain` say why it waited; the metrics count it."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from cachepilot.core import WorkerMetrics
from cachepilot.core.flow import info as fi
from cachepilot.core.flow.config import FlowConfig
from cachepilot.gateway.director import Pending
from cachepilot.gateway.envoy_streams import RoutingStream
from cachepilot.gateway.flow_metrics import FlowMetrics, TenantLabels
from cachepilot.gateway.protocol import (
    ATTRIBUTES_KEY,
    DESTINATION_HEADER,
    header_attribute,
)
from cachepilot.records.explain import flow_line, summary
from cachepilot.records.schema import decision_to_record

from helpers.extproc_msgs import body, headers, set_headers
from helpers.gateway_box import Box
from helpers.routers import WORKERS

CHAT = "/v1/chat/completions"
pytestmark = pytest.mark.timeout(30)


def _raw(text: str = "hi") -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _box(**cfg: object) -> tuple[Box, Clock]:
    clock = Clock()
    box = Box(clock=clock, flow=FlowConfig(**cfg))  # type: ignore[arg-type]
    box.metrics_flow = FlowMetrics(box.metrics.registry, box.flow)  # type: ignore[attr-defined]
    box.flow.observers.append(box.metrics_flow)  # type: ignore[union-attr]
    return box, clock


def _saturate(box: Box, now: float, open_: str | None = None) -> None:
    """Every worker's batch of 4 full with one more waiting, but ``open_``'s: a free place."""
    pool = box.router.pools["default"]
    for w in WORKERS:
        waiting, running = (0, 3) if w == open_ else (1, 4)
        pool.workers[w].inflight = waiting + running
        pool.update_metrics(w, WorkerMetrics(waiting=waiting, running=running, max_batch=4,
                                             kv_usage=0.1, scraped_at=now))


async def _held(box: Box, msg: ep.ProcessingRequest
                ) -> tuple[RoutingStream, asyncio.Future[list[ep.ProcessingResponse]]]:
    """A body-only stream's request held by flow control, its wait started: (stream, task)."""
    s = box.stream(body_only=True, observe="off", path=CHAT)
    out = box.handle(s, msg)
    assert isinstance(out, Pending) and box.flow.held == 1
    task = asyncio.ensure_future(out.answers())
    await asyncio.sleep(0)
    return s, task


def _tenant(msg, tenant: str):  # type: ignore[no-untyped-def]
    attrs = struct_pb2.Struct()
    attrs.update({header_attribute("x-gateway-inference-fairness-id"): tenant})
    msg.attributes[ATTRIBUTES_KEY].CopyFrom(attrs)
    return msg


async def test_a_held_body_only_request_is_answered_when_a_worker_opens() -> None:
    box, clock = _box()
    _saturate(box, clock.now)
    s, task = await _held(box, _tenant(body(_raw()), "acme"))
    clock.now += 0.25
    _saturate(box, clock.now, open_=WORKERS[2])
    box.flow.pump(clock.now)
    [resp] = await task
    assert set_headers(resp)[DESTINATION_HEADER] == WORKERS[2]
    d = s.ex.decision
    assert d is not None and d.flow is not None and d.flow.tenant == "acme"
    assert d.flow.held_ms == pytest.approx(250.0) and d.flow.hold_reason == fi.POOL_FULL
    rec = decision_to_record(d)
    assert rec["flow"]["held_ms"] == pytest.approx(250.0)
    line = flow_line(rec)
    assert line and "held 250 ms because every worker was busy" in line
    assert summary({**rec, "outcome": None})["waited"] == line


async def test_a_refusal_is_a_429_with_retry_after_and_a_reason() -> None:
    box, clock = _box(ttl_s=1.0)
    _saturate(box, clock.now)
    s = box.stream(body_only=True, observe="off", path=CHAT)
    out = box.handle(s, body(_raw()))
    assert isinstance(out, Pending)
    task = asyncio.ensure_future(out.answers())
    await asyncio.sleep(0)
    clock.now += 1.5
    box.flow.pump(clock.now)
    [resp] = await task
    imm = resp.immediate_response
    assert imm.status.code == 429
    hdrs = {h.header.key: h.header.raw_value.decode() for h in imm.headers.set_headers}
    assert hdrs["x-cachepilot-shed-reason"] == fi.TTL_EXPIRED and int(hdrs["retry-after"]) >= 1
    assert "time to live" in orjson.loads(imm.body)["error"]["message"]
    text = box.metrics.registry.get_sample_value(
        "cachepilot_flow_refused_total", {"pool": "default", "band": "0",
                                          "reason": fi.TTL_EXPIRED})
    assert text == 1.0


async def test_a_client_leaving_takes_its_request_out_of_the_queue() -> None:
    box, clock = _box()
    _saturate(box, clock.now)
    _, task = await _held(box, body(_raw()))
    task.cancel()  # what grpc.aio does when Envoy resets the stream
    with pytest.raises(asyncio.CancelledError):
        await task
    assert box.flow.held == 0
    assert box.metrics.registry.get_sample_value(
        "cachepilot_flow_cancelled_total", {"pool": "default", "band": "0"}) == 1.0


async def test_a_client_leaving_as_its_request_is_dispatched_frees_the_worker() -> None:
    """The race an overloaded gateway meets when clients give up: the held request is
    dispatched (booked on a worker) and its stream is cancelled before the wait resumes. The
    booking must go with the stream, or the worker counts it for ever and, never answering
    it, is taken for stalled."""
    box, clock = _box()
    _saturate(box, clock.now)
    s, task = await _held(box, body(_raw()))
    clock.now += 0.25
    _saturate(box, clock.now, open_=WORKERS[2])
    worker = box.router.pools["default"].workers[WORKERS[2]]
    before = worker.inflight
    box.flow.pump(clock.now)  # dispatched: booked on WORKERS[2], the wait not resumed yet
    assert worker.inflight == before + 1
    task.cancel()  # Envoy reset the stream in between
    with pytest.raises(asyncio.CancelledError):
        await task
    box.streams.routing_ended(s)  # the servicer's finally
    assert worker.inflight == before and s.ex.done
    assert not box.stalls.awaiting.get(WORKERS[2])
    assert box.sink.outcomes[s.ex.decision.id]["aborted"]


async def test_the_epp_stream_holds_too_and_reads_the_headers() -> None:
    box, clock = _box()
    _saturate(box, clock.now)
    stream = box.epp()
    assert stream.handle(headers(CHAT, **{"x-gateway-inference-fairness-id": "t1",
                                          "x-cachepilot-priority": "3"})) == []
    out = stream.handle(body(_raw()))
    assert isinstance(out, Pending)
    task = asyncio.ensure_future(out.answers())
    await asyncio.sleep(0)
    clock.now += 0.1
    _saturate(box, clock.now, open_=WORKERS[0])
    box.flow.pump(clock.now)
    first, *rest = await task
    assert set_headers(first)[DESTINATION_HEADER] == WORKERS[0]
    assert rest and rest[-1].request_body.response.body_mutation.streamed_response.end_of_stream
    d = stream.ex.decision
    assert d is not None and d.flow is not None and (d.flow.tenant, d.flow.priority) == ("t1", 3)


def test_an_unsaturated_pool_answers_at_once() -> None:
    box, _ = _box()
    s = box.stream(body_only=True, observe="off", path=CHAT)
    out = box.handle(s, body(_raw()))
    assert isinstance(out, list) and set_headers(out[0])[DESTINATION_HEADER] in WORKERS
    assert box.metrics.registry.get_sample_value(
        "cachepilot_flow_dispatched_total", {"pool": "default", "band": "0",
                                             "reason": fi.DIRECT}) == 1.0


def test_a_bad_priority_header_is_a_400() -> None:
    box, _ = _box()
    stream = box.epp()
    stream.handle(headers(CHAT, **{"x-cachepilot-priority": "urgent"}))
    [resp] = stream.handle(body(_raw()))
    assert resp.immediate_response.status.code == 400


def test_tenant_labels_are_bounded() -> None:
    labels = TenantLabels(2)
    assert [labels(t) for t in ("a", "b", "c", "a")] == ["a", "b", "other", "a"]

