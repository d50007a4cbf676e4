"""The endpoint picker stream adapter (cachepilot.gateway.epp), driven with ext_proc messages
as Envoy sends them in FULL_DUPLEX_STREAMED mode."""

from __future__ import annotations

import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from cachepilot.core.router import Router
from cachepilot.gateway.director import GatewayOptions
from cachepilot.gateway.epp import EppStream, allowed, served_endpoint, subset_hint
from cachepilot.gateway.protocol import (
    BODY_CHUNK_LIMIT,
    DESTINATION_HEADER,
    LB_METADATA_NAMESPACE,
    SERVED_KEY,
    SERVED_REPORT_HEADER,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
)
from cachepilot.gateway.service import ExtProcServicer

from helpers.extproc_msgs import body, headers, set_headers
from helpers.gateway_box import Box
from helpers.routers import WORKERS, make_router


def _meta(msg: ep.ProcessingRequest, namespace: str, key: str, value: object
          ) -> ep.ProcessingRequest:
    s = struct_pb2.Struct()
    s.update({key: value})
    msg.metadata_context.filter_metadata[namespace].CopyFrom(s)
    return msg


def _stream(router: Router | None = None) -> tuple[EppStream, Box]:
    p = Box(router or make_router(models=("m", "m2")))
    return p.epp(), p


def _payload(model: str = "m", prompt: str = "hello", **kw: object) -> bytes:
    return orjson.dumps({"model": model, "prompt": prompt, **kw})


def _streamed(out: list[ep.ProcessingResponse], key: str) -> tuple[bytes, bool]:
    """The body handed back in streamed_response chunks, and whether the last ends it."""
    parts = [getattr(r, key).response.body_mutation.streamed_response for r in out
             if r.WhichOneof("response") == key]
    assert all(len(p.body) <= BODY_CHUNK_LIMIT for p in parts)
    assert not any(p.end_of_stream for p in parts[:-1])
    return b"".join(p.body for p in parts), bool(parts) and parts[-1].end_of_stream


def test_subset_hint_list_string_and_absent() -> None:
    assert subset_hint(headers("/v1/completions")) is None
    as_list = _meta(headers("/x"), SUBSET_NAMESPACE, SUBSET_KEY, ["10.0.0.1:8000", "10.0.0.2:8000"])
    assert subset_hint(as_list) == {"10.0.0.1:8000", "10.0.0.2:8000"}
    as_text = _meta(headers("/x"), SUBSET_NAMESPACE, SUBSET_KEY, "10.0.0.1:8000, 10.0.0.3:8000")
    assert subset_hint(as_text) == {"10.0.0.1:8000", "10.0.0.3:8000"}
    assert subset_hint(_meta(headers("/x"), SUBSET_NAMESPACE, SUBSET_KEY, [])) == frozenset()
    assert allowed(WORKERS, frozenset({"10.0.0.2"})) == {"10.0.0.2:8000"}  # bare ip: any port
    assert allowed(WORKERS, frozenset({"10.0.0.2:9"})) == frozenset()


def test_full_duplex_exchange_routes_at_end_of_body_and_hands_the_body_back() -> None:
    s, p = _stream()
    raw = _payload(prompt="x" * 150_000)
    assert s.handle(headers("/v1/completions")) == []
    assert s.handle(body(raw[:70_000], eos=False)) == []
    out = s.handle(body(raw[70_000:], eos=True))
    first = out[0]
    assert first.WhichOneof("response") == "request_headers"
    hdrs = set_headers(first)
    dest = hdrs[DESTINATION_HEADER]
    assert dest in WORKERS
    # The same single endpoint in the header and in envoy.lb metadata.
    md = first.dynamic_metadata.fields[LB_METADATA_NAMESPACE].struct_value
    assert md.fields[DESTINATION_HEADER].string_value == dest
    assert len(hdrs["x-request-id"]) == 36  # generated: none came
    assert hdrs["content-length"] == str(len(raw))
    assert _streamed(out[1:], "request_body") == (raw, True)
    assert p.router.pools["default"].workers[dest].inflight == 1
    # The response: who served it is reported, the body streamed back, the request released.
    resp = _meta(headers("", response=True, content_type="application/json"),
                 LB_METADATA_NAMESPACE, SERVED_KEY, dest)
    reply = s.handle(resp)
    assert set_headers(reply[0])[SERVED_REPORT_HEADER] == dest
    out = s.handle(body(b'{"usage":{"prompt_tokens_details":{"cached_tokens":7}}}',
                        eos=True, response=True))
    assert _streamed(out, "response_body")[1]
    assert s.ex.done and s.ex.cached_tokens == 7
    assert p.router.pools["default"].workers[dest].inflight == 0


def test_client_request_id_is_kept() -> None:
    s, _ = _stream()
    s.handle(headers("/v1/completions", x_request_id="abc-123"))
    out = s.handle(body(_payload()))
    assert "x-request-id" not in set_headers(out[0])  # not overwritten
    assert s.request_id == "abc-123"


def test_subset_hint_limits_the_candidates_and_restores_the_pool() -> None:
    s, p = _stream()
    s.handle(_meta(headers("/v1/completions"), SUBSET_NAMESPACE, SUBSET_KEY, ["10.0.0.3:8000"]))
    out = s.handle(body(_payload()))
    assert set_headers(out[0])[DESTINATION_HEADER] == "10.0.0.3:8000"
    d = s.ex.decision
    assert d is not None
    assert {c.worker: c.filtered for c in d.candidates if c.filtered} == {
        "10.0.0.1:8000": "subset", "10.0.0.2:8000": "subset"}
    assert all(w.ready for w in p.router.pools["default"].workers.values())


@pytest.mark.parametrize("hint", [["192.0.2.1:9"], []])
def test_no_eligible_endpoint_in_the_subset_is_a_503(hint: list[str]) -> None:
    s, _ = _stream()
    s.handle(_meta(headers("/v1/completions"), SUBSET_NAMESPACE, SUBSET_KEY, hint))
    out = s.handle(body(_payload()))
    assert out[0].immediate_response.status.code == 503
    assert s.handle(body(b"", eos=True)) == []  # the exchange is over


@pytest.mark.parametrize(("payload", "status"), [
    (b"{oops", 400), (b'{"prompt":"no model"}', 400), (_payload(model="other"), 404)])
def test_errors_map_as_the_reference(payload: bytes, status: int) -> None:
    s, _ = _stream()
    s.handle(headers("/v1/completions"))
    out = s.handle(body(payload))
    assert out[0].immediate_response.status.code == status
    assert orjson.loads(out[0].immediate_response.body)["error"]["code"] == status


def test_saturated_pool_is_a_429() -> None:
    s, _ = _stream()
    s.d.clock = lambda: 10_000.0  # every worker's metrics are stale: unobserved, shed
    s.handle(headers("/v1/completions"))
    assert s.handle(body(_payload()))[0].immediate_response.status.code == 429


def test_bodyless_request_is_answered_at_the_headers() -> None:
    s, _ = _stream()
    out = s.handle(headers("/v1/models", method="GET", eos=True))
    target = set_headers(out[0])[DESTINATION_HEADER]
    assert target in WORKERS
    assert out[0].dynamic_metadata.fields[LB_METADATA_NAMESPACE].struct_value.fields[
        DESTINATION_HEADER].string_value == target


def test_model_rewrite_both_ways() -> None:
    s, _ = _stream()
    s.handle(headers("/v1/completions", x_gateway_model_name_rewrite="m2"))
    out = s.handle(body(_payload(model="m")))
    sent, _ = _streamed(out[1:], "request_body")
    assert orjson.loads(sent)["model"] == "m2"
    assert s.ex.decision is not None and s.ex.decision.model == "m2"
    reply = s.handle(headers("", response=True, content_type="application/json",
                             content_length="40"))
    assert "content-length" in reply[0].response_headers.response.header_mutation.remove_headers
    assert s.handle(body(b'{"model":"m2",', eos=False, response=True)) == []  # held
    out = s.handle(body(b'"x":1}', eos=True, response=True))
    assert _streamed(out, "response_body") == (b'{"model":"m","x":1}', True)


def test_body_ended_by_trailers_is_routed_then_the_trailers_answered() -> None:
    s, _ = _stream()
    s.handle(headers("/v1/completions"))
    assert s.handle(body(_payload(), eos=False)) == []
    out = s.handle(ep.ProcessingRequest(request_trailers=ep.HttpTrailers()))
    assert [r.WhichOneof("response") for r in out] == [
        "request_headers", "request_body", "request_trailers"]


def test_failover_reported_by_the_proxy_marks_the_chosen_worker_down() -> None:
    s, p = _stream()
    s.handle(headers("/v1/completions"))
    chosen = set_headers(s.handle(body(_payload()))[0])[DESTINATION_HEADER]
    other = next(w for w in WORKERS if w != chosen)
    s.handle(_meta(headers("", response=True), LB_METADATA_NAMESPACE, SERVED_KEY, other))
    assert "connect" in p.router.pools["default"].workers[chosen].down


def test_body_over_the_limit_is_a_413() -> None:
    s = Box(options=GatewayOptions(max_body_bytes=1000)).epp()
    s.handle(headers("/v1/completions"))
    assert s.handle(body(b"x" * 800, eos=False)) == []
    assert s.handle(body(b"x" * 800, eos=False))[0].immediate_response.status.code == 413


@pytest.mark.parametrize(("protocol", "ours", "epp"), [
    ("auto", True, False), ("auto", False, True), ("epp", True, True),
    ("cachepilot", False, False)])
def test_protocol_choice(protocol: str, ours: bool, epp: bool) -> None:
    servicer = ExtProcServicer(Box(options=GatewayOptions(protocol=protocol)).director)
    assert servicer._epp(ours) is epp


def test_served_endpoint_absent() -> None:
    assert served_endpoint(headers("", response=True)) is None


def test_who_answered_is_recorded() -> None:
    p = Box(make_router(models=("m",)))
    s = p.epp()
    s.handle(headers("/v1/completions"))
    dest = set_headers(s.handle(body(_payload()))[0])[DESTINATION_HEADER]
    s.handle(_meta(headers("", response=True), LB_METADATA_NAMESPACE, SERVED_KEY, dest))
    s.handle(body(b"{}", eos=True, response=True))
    [outcome] = p.sink.outcomes.values()
    assert outcome["extra"]["answered_by"] == dest and outcome["status"] == 200
