"""Bodies of every size and framing, through both protocols' stream handlers: split at any
byte, over 1 MB, a re-delivered end of stream, bodies the gateway cannot parse or hash."""

import itertools

import orjson
import pytest

from cachepilot.gateway.director import GatewayOptions
from cachepilot.gateway.envoy_streams import RoutingStream
from cachepilot.gateway.epp import EppStream

from helpers.extproc_msgs import body, headers
from helpers.gateway_box import Box

BIG = 8 << 20


def chat_body(text: str) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})


def streamed(box: Box, raw: bytes, cuts: list[int]) -> tuple[RoutingStream, list]:
    """Our STREAMED framing: headers, then the body cut at ``cuts``; the last answers."""
    s = RoutingStream()
    assert box.handle(s, headers("/v1/chat/completions")) == []
    bounds = [0, *cuts, len(raw)]
    out: list = []
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        out = box.handle(s, body(raw[a:b], eos=i == len(bounds) - 2))
    return s, out


def epp(box: Box, raw: bytes, cuts: list[int]) -> tuple[EppStream, list]:
    """The endpoint picker protocol's FULL_DUPLEX_STREAMED framing."""
    st = EppStream(box.director)
    assert st.handle(headers("/v1/chat/completions")) == []
    bounds = [0, *cuts, len(raw)]
    out: list = []
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        out = st.handle(body(raw[a:b], eos=i == len(bounds) - 2))
    return st, out


def decided(box: Box) -> list:
    return [d for d, _ in box.sink.decisions]


def test_a_body_split_at_any_byte_routes_as_the_whole() -> None:
    raw = chat_body("naïve café, 日本語の文書 " * 3)  # multi-byte characters cut in two
    whole = Box(options=GatewayOptions(max_body_bytes=BIG))
    streamed(whole, raw, [])
    expect = decided(whole)[0].hashes
    for cut in range(1, len(raw)):
        for run in (streamed, epp):
            box = Box(options=GatewayOptions(max_body_bytes=BIG))
            _, out = run(box, raw, [cut])
            assert not any(r.HasField("immediate_response") for r in out), (run, cut)
            assert [d.hashes for d in decided(box)] == [expect], (run, cut)
    box = Box(options=GatewayOptions(max_body_bytes=BIG))  # one byte a chunk
    _, out = streamed(box, raw, list(range(1, len(raw))))
    assert len(out) == 1 + len(raw) and decided(box)[0].hashes == expect


@pytest.mark.parametrize("run", [streamed, epp])
def test_bodies_over_a_megabyte_in_64k_chunks(run) -> None:  # type: ignore[no-untyped-def]
    raw = chat_body("a long shared document " * 250_000)  # ~5.7 MB
    whole = Box(options=GatewayOptions(max_body_bytes=BIG))
    run(whole, raw, [])
    box = Box(options=GatewayOptions(max_body_bytes=BIG))
    _, out = run(box, raw, list(range(65536, len(raw), 65536)))
    assert not any(r.HasField("immediate_response") for r in out)
    [d] = decided(box)
    assert d.hashes == decided(whole)[0].hashes and len(d.hashes) > 80_000


def test_a_re_delivered_end_of_stream_is_answered_once_and_never_routed_again() -> None:
    raw = chat_body("duplicate end of stream " * 3000)
    box = Box(options=GatewayOptions(max_body_bytes=BIG))
    s, _ = streamed(box, raw, [len(raw) // 2])
    again = box.handle(s, body(raw[len(raw) // 2:], eos=True))
    assert [r.WhichOneof("response") for r in again] == ["request_body"]
    assert not again[0].request_body.HasField("response")
    only = box.stream(body_only=True, path="/v1/chat/completions", observe="async")
    assert box.handle(only, body(raw))[0].HasField("request_body")
    assert box.handle(only, body(raw)) == []  # a body-only stream answers its body once
    assert len(decided(box)) == 2


@pytest.mark.parametrize("raw", [b"{oops", b"[1, 2]", b'{"model": "m", "prompt": "x"'])
def test_an_unparseable_body_is_routed_by_load_in_our_protocol(raw: bytes) -> None:
    box = Box()
    only = box.stream(body_only=True, path="/v1/completions", observe="async")
    [answer] = box.handle(only, body(raw))
    assert answer.HasField("request_body") and answer.dynamic_metadata.fields
    [d] = decided(box)
    assert d.request.kind == "unparsed" and d.hashes == ()
    _, out = streamed(Box(), raw, [1])
    assert out[0].HasField("request_headers")  # the destination, no refusal


def test_an_unparseable_body_is_a_400_in_the_endpoint_picker_protocol() -> None:
    """The reference EPP answers it 400 (conformance rule R01): so do we there."""
    box = Box()
    _, out = epp(box, b"{oops", [2])
    assert out[0].immediate_response.status.code == 400 and not decided(box)


@pytest.mark.parametrize("prompt", [[-1, 5, 7], [1 << 40, 2], [[3, 1 << 33]]])
@pytest.mark.parametrize("run", [streamed, epp])
def test_token_ids_that_cannot_be_hashed_are_routed_by_load_not_a_500(run, prompt) -> None:  # type: ignore[no-untyped-def]
    raw = orjson.dumps({"model": "m", "prompt": prompt})
    box = Box()
    st = RoutingStream() if run is streamed else EppStream(box.director)
    handle = (lambda m: box.handle(st, m)) if run is streamed else st.handle
    handle(headers("/v1/completions"))
    out = handle(body(raw))
    assert not any(r.HasField("immediate_response") for r in out)
    [d] = decided(box)
    assert d.hashes == () and d.fallback == "unhashable"
