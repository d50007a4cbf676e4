"""Our Envoy streams over the director, driven with Envoy-shaped messages, no network."""

import asyncio

import orjson
import pytest

from cachepilot.core import WorkerMetrics
from cachepilot.gateway.director import GatewayOptions, Phase
from cachepilot.gateway.envoy_streams import RoutingStream
from cachepilot.gateway.protocol import DECISION_HEADER, DESTINATION_HEADER, WORKER_HEADER
from cachepilot.gateway.service import ExtProcServicer

from helpers.extproc_msgs import access_log_entry, body, headers, set_headers
from helpers.gateway_box import Box
from helpers.routers import WORKERS


@pytest.fixture
def proc() -> Box:
    return Box(options=GatewayOptions(max_body_bytes=10_000))


def chat(text: str = "hello", **kw) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}], **kw})


def exchange(proc: Box, raw: bytes, path: str = "/v1/chat/completions"):
    """Headers, then the body in two STREAMED chunks; returns the routing stream and the
    answer to the last chunk."""
    s = RoutingStream()
    out = proc.handle(s, headers(path, content_length=str(len(raw))))
    if out:  # rejected at the headers
        return s, out[0]
    half = len(raw) // 2
    assert proc.handle(s, body(raw[:half], eos=False)) == []
    out = proc.handle(s, body(raw[half:], eos=True))
    return s, out[0] if len(out) == 1 else out


def test_headers_answer_waits_for_the_body_then_names_the_worker(proc: Box) -> None:
    s, out = exchange(proc, chat())
    kinds = [r.WhichOneof("response") for r in out]
    assert kinds == ["request_headers", "request_body", "request_body"]  # Envoy's order
    hdrs = set_headers(out[0])
    assert hdrs[DESTINATION_HEADER] in WORKERS
    assert hdrs[DECISION_HEADER] == s.ex.decision.id
    assert out[0].request_headers.response.clear_route_cache


def test_response_headers_return_decision_and_worker_and_release(proc: Box) -> None:
    s, _ = exchange(proc, chat(stream=True))
    w = proc.router.pools["default"].workers[s.ex.decision.chosen]
    assert w.inflight == 1
    # Envoy names the worker that answered (%UPSTREAM_HOST%); the gateway adds the decision.
    [r] = proc.handle(s, headers("", response=True, **{WORKER_HEADER: s.ex.decision.chosen}))
    assert set_headers(r) == {DECISION_HEADER: s.ex.decision.id}
    proc.handle(s, body(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n', eos=False,
                         response=True))
    assert w.pending_prefill_tokens == 0  # first token seen
    proc.handle(s, body(b'data: {"usage":{"prompt_tokens_details":{"cached_tokens":96}}}\n\n'
                         b"data: [DONE]\n\n", eos=True, response=True))
    assert w.inflight == 0
    out = proc.sink.outcomes[s.ex.decision.id]
    assert out["cached_tokens"] == 96 and out["status"] == 200 and not out["aborted"]
    assert out["ttft_kind"] == "first_token"


def test_cached_tokens_found_across_chunk_boundary(proc: Box) -> None:
    s, _ = exchange(proc, chat())
    proc.handle(s, headers("", response=True))
    proc.handle(s, body(b'{"usage":{"prompt_tokens_details":{"cached_to', eos=False,
                         response=True))
    proc.handle(s, body(b'kens": 1234}}}', eos=True, response=True))
    assert proc.sink.outcomes[s.ex.decision.id]["cached_tokens"] == 1234


def test_aborted_stream_still_releases(proc: Box) -> None:
    s, _ = exchange(proc, chat())
    proc.director.finish(s.ex, aborted=True)
    assert proc.router.pools["default"].workers[s.ex.decision.chosen].inflight == 0
    assert proc.sink.outcomes[s.ex.decision.id]["aborted"]


@pytest.mark.parametrize(("raw", "status"), [
    (orjson.dumps({"model": "m"}), 400),
    (orjson.dumps({"model": 1, "messages": []}), 400),
])
def test_bad_bodies_get_json_errors(proc: Box, raw: bytes, status: int) -> None:
    _, resp = exchange(proc, raw)
    imm = resp.immediate_response
    assert imm.status.code == status
    assert "message" in orjson.loads(imm.body)["error"]


def test_oversized_body_is_413_at_headers(proc: Box) -> None:
    s = RoutingStream()
    [resp] = proc.handle(s, headers("/v1/completions", content_length="20000"))
    assert resp.immediate_response.status.code == 413
    assert b"limit of 10000" in resp.immediate_response.body


def test_chunked_body_over_the_limit_is_413(proc: Box) -> None:
    s = RoutingStream()
    assert proc.handle(s, headers("/v1/completions")) == []  # no content-length
    assert proc.handle(s, body(b"x" * 6000, eos=False)) == []
    [resp] = proc.handle(s, body(b"x" * 6000, eos=False))
    assert resp.immediate_response.status.code == 413


def test_empty_body_is_400(proc: Box) -> None:
    [resp] = proc.handle(RoutingStream(), headers("/v1/completions", eos=True))
    assert resp.immediate_response.status.code == 400


def test_all_full_is_429_with_retry_after(proc: Box) -> None:
    for w in WORKERS:
        proc.router.pools["default"].update_metrics(
            w, WorkerMetrics(waiting=1000, running=64, scraped_at=100.0))
    _, resp = exchange(proc, chat())
    imm = resp.immediate_response
    assert imm.status.code == 429
    hdrs = {h.header.key: h.header.raw_value for h in imm.headers.set_headers}
    assert int(hdrs["retry-after"]) >= 1


def test_get_models_passes_through_to_a_ready_worker(proc: Box) -> None:
    [resp] = proc.handle(RoutingStream(), headers("/v1/models", method="GET", eos=True))
    assert set_headers(resp)[DESTINATION_HEADER] in WORKERS


@pytest.mark.parametrize("protocol", ["cachepilot", "epp"])
def test_a_bug_in_routing_costs_one_request_not_the_gateway(proc: Box, monkeypatch,
                                                             protocol: str) -> None:
    proc.options.protocol = protocol  # a stream without gRPC context: either way

    def boom(*a, **k):
        raise RuntimeError("bug")

    monkeypatch.setattr(proc.router, "route", boom)
    raw = chat()

    async def stream():
        yield headers("/v1/chat/completions", content_length=str(len(raw)))
        yield body(raw)

    async def collect():
        return [r async for r in ExtProcServicer(proc.director).Process(stream(), None)]

    out = asyncio.run(collect())
    assert out[-1].immediate_response.status.code == 500


def test_an_observing_stream_takes_the_request_over_and_records_its_outcome(proc) -> None:
    s, _ = exchange(proc, chat(stream=True))
    d = s.ex.decision
    w = proc.router.pools["default"].workers[d.chosen]
    handover = proc.streams.handover
    proc.streams.routing_ended(s)  # Envoy ends the routing stream with the request phase
    assert w.inflight == 1 and d.id in handover.unobserved  # handed over, not released
    obs = proc.observe(None, headers("/v1/chat/completions", **{DECISION_HEADER: d.id}))
    assert obs is s.ex and d.id not in handover.unobserved
    proc.observe(obs, headers("", response=True, **{WORKER_HEADER: d.chosen}))
    proc.observe(obs, body(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n', eos=False,
                           response=True))
    proc.observe(obs, body(b'data: {"usage":{"prompt_tokens_details":{"cached_tokens":32}}}'
                           b'\n\n', eos=True, response=True))
    assert s.ex.done and s.ex.phase is Phase.DONE and w.inflight == 0
    assert d.id not in handover.live
    out = proc.sink.outcomes[d.id]
    assert out["cached_tokens"] == 32 and out["ttft_kind"] == "first_token" and not out["aborted"]
    proc.streams.observing_ended(obs)  # nothing more to release
    assert w.inflight == 0


def test_an_observing_stream_can_start_at_the_response_headers(proc) -> None:
    s, _ = exchange(proc, chat())
    d = s.ex.decision
    proc.streams.routing_ended(s)
    # Envoy's route adds the decision id to the response (%REQ(x-cachepilot-decision-id)%).
    obs = proc.observe(None, headers("", response=True, **{WORKER_HEADER: d.chosen,
                                                            DECISION_HEADER: d.id}))
    assert obs is s.ex
    proc.observe(obs, body(b'{"usage":{"prompt_tokens_details":{"cached_tokens":7}}}',
                           response=True))
    assert proc.sink.outcomes[d.id]["cached_tokens"] == 7
    assert proc.sink.outcomes[d.id]["ttft_kind"] == "first_byte"


def test_a_client_gone_before_any_answer_is_released_when_its_observing_stream_ends(proc):
    s, _ = exchange(proc, chat())
    proc.streams.routing_ended(s)
    obs = proc.observe(None, headers("/v1/chat/completions",
                                     **{DECISION_HEADER: s.ex.decision.id}))
    proc.streams.observing_ended(obs)
    assert proc.sink.outcomes[s.ex.decision.id]["aborted"]
    assert proc.router.pools["default"].workers[s.ex.decision.chosen].inflight == 0


def test_a_request_no_observing_stream_takes_over_is_released_later() -> None:
    now = [100.0]
    p = Box(clock=lambda: now[0], options=GatewayOptions(unobserved_after_s=10.0))
    s, _ = exchange(p, chat())
    p.streams.routing_ended(s)
    w = p.router.pools["default"].workers[s.ex.decision.chosen]
    p.streams.sweep(105.0)
    assert w.inflight == 1
    p.streams.sweep(111.0)
    assert w.inflight == 0 and p.sink.outcomes[s.ex.decision.id]["aborted"]
    # An observing stream for an unknown or finished decision observes nothing.
    assert p.observe(None, headers("/v1/chat/completions",
                                   **{DECISION_HEADER: s.ex.decision.id})) is None


def _first_token_exchange(p: Box):
    """A request routed on a stream Envoy's default config opened (observed until the first
    token), its observing stream bound; its routing stream stays open until Envoy ends the
    request."""
    s, _ = exchange(p, chat(stream=True))
    s.observe = "first-token"
    p.streams._routed(s, s.ex.decision)  # what routing a first-token stream registers
    assert p.streams.awaits_end(s)
    d = s.ex.decision
    obs = p.observe(None, headers("/v1/chat/completions", **{DECISION_HEADER: d.id}))
    assert obs is s.ex
    return s, d, p.router.pools["default"].workers[d.chosen]


def _past_the_first_token(p: Box):
    """The same, its response started and its first token seen: the gateway closed the
    observing stream; only the access log (or the routing stream's close) ends it now."""
    s, d, w = _first_token_exchange(p)
    p.observe(s.ex, headers("", response=True))
    p.observe(s.ex, body(b"data: {}\n\n", eos=False, response=True))
    p.streams.observing_ended(s.ex)
    return s, d, w


def test_observed_until_the_first_token_the_access_log_ends_the_request(proc) -> None:
    s, d, w = _first_token_exchange(proc)
    proc.observe(s.ex, headers("", response=True, **{WORKER_HEADER: d.chosen}))
    proc.observe(s.ex, body(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n', eos=False,
                            response=True))
    assert w.pending_prefill_tokens == 0 and s.ex.first_token_s is not None
    proc.streams.observing_ended(s.ex)  # the gateway closed it at the first token
    assert w.inflight == 1 and not s.ex.done  # the answer is still streaming
    proc.streams.logged(access_log_entry(d.id, upstream=d.chosen,
                                         usage={"cached_tokens": 64, "completion_tokens": 9}))
    assert w.inflight == 0 and s.ex.done
    out = proc.sink.outcomes[d.id]
    assert out["cached_tokens"] == 64 and out["completion_tokens"] == 9
    assert out["status"] == 200 and not out["aborted"] and out["ttft_kind"] == "first_token"
    assert not proc.streams.handover.unlogged and not proc.streams.handover.live
    proc.streams.logged(access_log_entry(d.id))  # a repeated entry changes nothing
    assert proc.sink.outcomes[d.id]["cached_tokens"] == 64


def test_an_access_log_entry_before_the_observing_stream_ends_the_request(proc) -> None:
    # The entry names the decision in the logged request headers (Envoy's config with a
    # headers message); the observing stream, processed later, finds nothing left to do.
    s, _ = exchange(proc, chat())
    s.observe = "first-token"
    proc.streams._routed(s, s.ex.decision)
    proc.streams.routing_ended(s)
    d = s.ex.decision
    proc.streams.logged(access_log_entry(d.id, status=503, by_metadata=False))
    assert s.ex.done and proc.sink.outcomes[d.id]["status"] == 503
    assert proc.observe(None, headers("/v1/chat/completions", **{DECISION_HEADER: d.id})) is None
    assert not proc.streams.handover.unobserved and not proc.streams.handover.unlogged


def test_a_client_gone_mid_answer_is_logged_as_aborted(proc) -> None:
    _, d, w = _past_the_first_token(proc)
    proc.streams.logged(access_log_entry(d.id, downstream_connection_termination=True))
    assert proc.sink.outcomes[d.id]["aborted"] and w.inflight == 0


def test_before_the_first_token_the_observing_streams_end_still_releases(proc) -> None:
    # Envoy ends the observing stream with the request: no first token, nothing to wait for.
    s, d, w = _first_token_exchange(proc)
    proc.streams.observing_ended(s.ex)
    assert w.inflight == 0 and proc.sink.outcomes[d.id]["aborted"]


def test_a_request_whose_access_log_entry_never_comes_is_released_later() -> None:
    now = [100.0]
    p = Box(clock=lambda: now[0], options=GatewayOptions(unlogged_after_s=60.0))
    _, d, w = _past_the_first_token(p)
    p.streams.sweep(150.0)
    assert w.inflight == 1
    p.streams.sweep(161.0)
    assert w.inflight == 0 and p.sink.outcomes[d.id]["aborted"]
    h = p.streams.handover
    assert not h.unlogged and not h.live and not h.unobserved and not h.ended


def test_a_request_that_ended_without_an_access_log_entry_is_released_after_the_grace() -> None:
    now = [100.0]
    p = Box(clock=lambda: now[0], options=GatewayOptions(logged_grace_s=5.0))
    s, d, w = _past_the_first_token(p)
    now[0] = 130.0
    p.streams.routing_ended(s)  # Envoy ended the request; its entry was lost
    assert w.inflight == 0  # the worker is free at once; the outcome waits for the entry
    p.streams.sweep(134.0)
    assert d.id not in p.sink.outcomes
    p.streams.sweep(135.0)
    assert w.inflight == 0 and p.sink.outcomes[d.id]["aborted"]
    assert p.sink.outcomes[d.id]["ttft_kind"] == "first_token"  # what was seen is kept
    assert not p.streams.handover.unlogged and not p.streams.handover.ended


def test_an_entry_before_the_streams_end_frees_the_worker_at_envoys_end() -> None:
    """Envoy's entry can come before the routing stream's close (each entry at once): the
    worker is freed when Envoy says the response ended, not when the entry arrived."""
    now = [100.0]
    p = Box(clock=lambda: now[0], options=GatewayOptions(max_body_bytes=10_000))
    s = p.stream(body_only=True, path="/v1/chat/completions", observe="first-token")
    p.handle(s, body(chat(), eos=True))
    d = s.ex.decision
    w = p.router.pools["default"].workers[d.chosen]
    now[0] = 100.9
    p.streams.logged(access_log_entry(d.id, upstream=d.chosen, body_in_s=0.010,
                                      first_byte_in_s=0.260, ended_in_s=0.600))
    assert w.inflight == 0 and s.ex.done and w.freed_at == pytest.approx(100.59)
    p.streams.routing_ended(s)  # then the close: nothing more to do
    assert w.inflight == 0 and not p.sink.outcomes[d.id]["aborted"]


def test_an_answer_that_is_not_streamed_is_ended_by_the_access_log_alone() -> None:
    """Observed until the first token and not streamed: the routing answer marks it
    unobserved (Envoy's route then skips the observing filter), the routing stream's end
    leaves it to the log, and the entry's timings place its first byte."""
    from cachepilot.gateway.protocol import UNOBSERVED_KEY

    now = [100.0]
    p = Box(clock=lambda: now[0], options=GatewayOptions(max_body_bytes=10_000))
    s = p.stream(body_only=True, path="/v1/chat/completions", observe="first-token")
    [out] = p.handle(s, body(chat(), eos=True))
    d = s.ex.decision
    lb = out.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert lb[UNOBSERVED_KEY].string_value == "1"
    assert p.streams.awaits_end(s)  # the stream stays open until Envoy ends the request
    w = p.router.pools["default"].workers[d.chosen]
    assert not s.ex.done and w.inflight == 1 and d.id not in p.streams.handover.live
    now[0] = 100.6
    p.streams.routing_ended(s)  # Envoy ended the request: its entry is due
    # The worker is free at once (the next request is priced without this one), its
    # prefill over; the outcome waits for the entry.
    assert w.inflight == 0 and w.pending_requests == 0 and not s.ex.done
    assert d.id not in p.sink.outcomes
    now[0] = 100.9  # the entry arrives a while after the answer's end (Envoy batches them)
    p.streams.logged(access_log_entry(d.id, upstream=d.chosen, body_in_s=0.010,
                                      first_byte_in_s=0.260, ended_in_s=0.600,
                                      usage={"cached_tokens": 5}))
    out = p.sink.outcomes[d.id]
    assert w.inflight == 0 and not out["aborted"] and out["cached_tokens"] == 5
    assert out["ttft_kind"] == "first_byte" and out["first_byte_ms"] == pytest.approx(250.0)
    # The worker was free when Envoy ended the request (its routing stream closed), not
    # when the entry came.
    assert w.freed_at == pytest.approx(100.6)
    assert not p.streams.handover.ended
    # The client left before Envoy applied the routing answer: the request ends (its stream
    # closes) and no entry names the decision; released once the grace has passed.
    s = p.stream(body_only=True, path="/v1/chat/completions", observe="first-token")
    p.handle(s, body(chat(), eos=True))
    p.streams.routing_ended(s)
    p.streams.sweep(now[0] + 4.0)
    assert not s.ex.done
    p.streams.sweep(now[0] + 5.0)
    assert s.ex.done and p.sink.outcomes[s.ex.decision.id]["aborted"]
    assert not p.streams.handover.unlogged and not p.streams.handover.ended
    # Streamed, the same request is observed (until its first token).
    s = p.stream(body_only=True, path="/v1/chat/completions", observe="first-token")
    [out] = p.handle(s, body(chat(stream=True), eos=True))
    assert UNOBSERVED_KEY not in out.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert s.ex.decision.id in p.streams.handover.live


def test_envoys_own_error_reply_in_the_access_log_marks_the_worker_down() -> None:
    p = Box(options=GatewayOptions(max_body_bytes=10_000))
    s = p.stream(body_only=True, path="/v1/chat/completions", observe="first-token")
    p.handle(s, body(chat(), eos=True))
    d = s.ex.decision
    p.streams.routing_ended(s)
    p.streams.logged(access_log_entry(d.id, status=503, error="worker_unreachable",
                                      upstream_connection_failure=True))
    assert p.sink.outcomes[d.id]["status"] == 503
    assert p.router.pools["default"].workers[d.chosen].down


def test_the_servicer_closes_an_observing_stream_at_the_first_token(proc) -> None:
    s, _ = exchange(proc, chat(stream=True))
    s.observe = "first-token"
    proc.streams._routed(s, s.ex.decision)
    proc.streams.routing_ended(s)
    d = s.ex.decision
    sent = [headers("/v1/chat/completions", **{DECISION_HEADER: d.id}),
            headers("", response=True),
            *[body(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n', eos=False,
                   response=True) for _ in range(5)]]
    read = []

    async def stream():
        for m in sent:
            read.append(m)
            yield m

    class Context:
        def invocation_metadata(self):
            return (("x-cachepilot-role", "observe"), ("x-cachepilot-observe", "first-token"))

    servicer = ExtProcServicer(proc.director)
    servicer.streams = proc.streams  # the streams that routed it

    async def run():
        return [r async for r in servicer.Process(stream(), Context())]

    assert asyncio.run(run()) == []
    assert len(read) == 3  # headers, response headers, the first token: then it closed
    assert not s.ex.done and d.id in proc.streams.handover.unlogged


def test_a_buffered_body_is_routed_by_the_answer_to_the_body(proc) -> None:
    raw = chat()
    s = RoutingStream(buffered=True)
    [cont] = proc.handle(s, headers("/v1/chat/completions", content_length=str(len(raw))))
    assert cont.WhichOneof("response") == "request_headers"
    assert not cont.request_headers.response.header_mutation.set_headers  # just go on
    [out] = proc.handle(s, body(raw, eos=True))
    assert out.WhichOneof("response") == "request_body"
    hdrs = {h.header.key: h.header.raw_value.decode()
            for h in out.request_body.response.header_mutation.set_headers}
    assert hdrs[DESTINATION_HEADER] == s.ex.decision.chosen
    assert hdrs[DECISION_HEADER] == s.ex.decision.id
    assert out.request_body.response.clear_route_cache
    assert out.dynamic_metadata.fields["envoy.lb"].struct_value.fields[
        DESTINATION_HEADER].string_value.startswith(s.ex.decision.chosen)


def test_envoys_config_on_the_stream_says_who_releases_the_request(proc) -> None:
    # Envoy answered on the routing stream ("sync", e.g. several replicas behind one Envoy):
    # the routing stream's end releases a request that got no answer, at once.
    raw = chat()
    s = RoutingStream(observe="sync")
    proc.handle(s, headers("/v1/chat/completions", content_length=str(len(raw))))
    proc.handle(s, body(raw))
    proc.streams.routing_ended(s)
    assert s.ex.done and proc.sink.outcomes[s.ex.decision.id]["aborted"]
    # "async": the observing stream will.
    s2 = RoutingStream(observe="async")
    proc.handle(s2, headers("/v1/chat/completions", content_length=str(len(raw))))
    proc.handle(s2, body(raw))
    proc.streams.routing_ended(s2)
    assert not s2.ex.done and s2.ex.decision.id in proc.streams.handover.unobserved


def test_a_routing_stream_that_carried_the_response_leaves_nothing_to_hand_over(proc) -> None:
    raw = chat()
    s = RoutingStream()  # the default "async", but Envoy sent the response here after all
    proc.handle(s, headers("/v1/chat/completions", content_length=str(len(raw))))
    proc.handle(s, body(raw))
    proc.handle(s, headers("", response=True, **{WORKER_HEADER: s.ex.decision.chosen}))
    proc.handle(s, body(b"{}", eos=True, response=True))
    proc.streams.routing_ended(s)
    assert s.ex.done and not proc.streams.handover.live
    assert not proc.streams.handover.unobserved


def test_a_body_only_stream_routes_by_metadata_in_one_answer(proc) -> None:
    """The default bootstrap sends the routing stream no headers: the path comes from the
    route's metadata, the one answer routes through envoy.lb metadata, and the observing
    stream binds by the decision id Envoy forwards in that metadata."""
    from cachepilot.gateway.protocol import CHOSEN_KEY, lb_metadata

    s = proc.stream(body_only=True, path="/v1/chat/completions")
    [out] = proc.handle(s, body(chat(stream=True), eos=True))
    d = s.ex.decision
    assert out.WhichOneof("response") == "request_body"
    assert out.request_body.response.clear_route_cache  # the route sees the metadata
    # Not applied (Envoy sent no headers), but Envoy clears the route cache only for an
    # answer with a header mutation.
    assert set_headers(out)[DESTINATION_HEADER] == d.chosen
    lb = out.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert lb[DESTINATION_HEADER].string_value.split(",")[0] == d.chosen
    assert lb[CHOSEN_KEY].string_value == d.chosen and lb[DECISION_HEADER].string_value == d.id
    assert s.ex.started == 100.0 and s.ex.stream
    proc.streams.routing_ended(s)
    # Envoy's observing filter forwards envoy.lb: the request headers carry no decision header.
    first = headers("/v1/chat/completions")
    first.metadata_context.filter_metadata["envoy.lb"].CopyFrom(
        lb_metadata(d.chosen, **{DECISION_HEADER: d.id}).fields["envoy.lb"].struct_value)
    assert proc.observe(None, first) is s.ex


@pytest.mark.parametrize(("path", "raw", "status"), [
    ("/v1/chat/completions", b"", 400),
    ("/v1/chat/completions", chat("x" * 20_000), 413),
    ("", chat(), 500),  # Envoy's route named no inference path: a config mismatch
], ids=["empty", "too-large", "no-path"])  # not JSON: routed by load (test_bodies)
def test_a_body_only_stream_answers_bad_input_with_json(proc, path, raw, status) -> None:
    [out] = proc.handle(proc.stream(body_only=True, path=path), body(raw, eos=True))
    assert out.immediate_response.status.code == status
    assert orjson.loads(out.immediate_response.body)["error"]["message"]
