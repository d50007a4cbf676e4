"""Bodies in streaming mode: handed back intact (small, large, chunked, split at any byte),
responses streamed as produced, a duplicate end-of-stream, a body the EPP cannot parse, a
body over the EPP's limit."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson

from cachepilot.conformance import wire
from cachepilot.conformance.rules import (
    COMPLETIONS,
    EXTENSION,
    PROTOCOL,
    REFERENCE,
    Context,
    canonical,
    endpoints,
    expect,
    expect_refused,
    rule,
)
from cachepilot.conformance.sources import Source, epp, issue, proto
from cachepilot.conformance.workers import BODY_SHA_HEADER

_STREAMING = proto("L17", "The EPP MUST support streaming mode for inference requests and "
                          "responses. Streaming mode enables full-duplex communication between "
                          "the Gateway (Envoy), EPP, and model servers, allowing real-time "
                          "token-by-token response delivery for AI inference workloads.")
_EXT_PROC = proto("L14-15", "The EPP MUST implement the Envoy external processing service "
                            "protocol.")


async def _body_intact(ctx: Context, payload: dict[str, Any], chunked: bool = False) -> None:
    raw = orjson.dumps(payload)
    if chunked:
        async def pieces() -> AsyncIterator[bytes]:
            for i in range(0, len(raw), 50_000):
                yield raw[i:i + 50_000]
        r = await ctx.post(data=pieces(), headers={"content-type": "application/json"})
    else:
        r = await ctx.post(data=raw, headers={"content-type": "application/json"})
    expect(r, 200, f"{len(raw)}-byte request")
    seen = r.seen()
    assert seen["body_bytes"] == len(raw), f"worker got {seen['body_bytes']} of {len(raw)} bytes"
    assert seen["body_sha256"] == hashlib.sha256(raw).hexdigest(), "body altered on the way"
    assert seen["content-length"] in (None, str(len(raw))), (
        f"content-length {seen['content-length']} for a {len(raw)}-byte body")
    assert r.headers.get(BODY_SHA_HEADER) == hashlib.sha256(r.body).hexdigest(), \
        "response body altered on the way"


@rule("P11", "RequestBodyIntact", PROTOCOL,
      "In streaming mode the EPP hands the request body back byte for byte, with a matching "
      "content-length if any: a small body, 3 MB (many chunks both ways), 1 MB chunked "
      "(no content-length), and a 2 MB answer back to the client.",
      _STREAMING, _EXT_PROC)
async def check_request_body_intact(ctx: Context) -> None:
    await _body_intact(ctx, ctx.body("small"))
    await _body_intact(ctx, ctx.body("large " + "lorem ipsum " * 250_000))
    await _body_intact(ctx, ctx.body("chunked " + "dolor sit " * 100_000), chunked=True)
    await _body_intact(ctx, ctx.body("big answer", conformance={"response_bytes": 2_000_000}))


# Multi-byte UTF-8 and JSON escapes: a split inside either must not matter.
_SPLIT_BODY = orjson.dumps({"model": "@MODEL@", "max_tokens": 4,
                            "prompt": 'caf\u00e9 \u20ac \U0001F600 "q" \\ \n \t \u00fc'
                                      + "\u4e2d\u6587 end"}).replace(b'\\n', b'\\u000a')


@rule("P12", "BodySplitAnywhere", PROTOCOL,
      "A request body split at any byte (inside a UTF-8 character, inside a JSON escape, one "
      "byte a message, an empty last chunk) is routed once and handed back byte for byte "
      "(a direct ext_proc client playing Envoy sends every split).",
      _STREAMING, _EXT_PROC)
async def check_split_anywhere(ctx: Context) -> None:
    body = _SPLIT_BODY.replace(b"@MODEL@", ctx.cfg.model.encode())
    splits: list[list[bytes]] = [[body[:k], body[k:]] for k in range(1, len(body))]
    splits += [[body[i:i + 1] for i in range(len(body))], [body, b""]]
    pool = {canonical(a) for a in ctx.addresses}

    async def one(chunks: list[bytes]) -> None:
        msgs = [wire.request_headers(hint=ctx.base_hint)]
        msgs += [wire.request_body(c, i == len(chunks) - 1) for i, c in enumerate(chunks)]
        ex = await ctx.wire.exchange(msgs)
        where = f"body split as {[len(c) for c in chunks][:6]}..."
        assert ex.immediate is None, (
            f"{where}: refused {ex.immediate.status.code}: {ex.immediate.body[:200]!r}")
        assert not ex.error, f"{where}: {ex.error}"
        answers = ex.of("request_headers")
        assert len(answers) == 1, f"{where}: {len(answers)} request-headers answers"
        header, meta = ex.destination()
        named = endpoints(header or meta)
        assert named and all(canonical(e) in pool for e in named), (
            f"{where}: destination {header!r} / {meta!r}")
        got, ended = ex.body()
        assert ended, f"{where}: the body's end was not handed back"
        assert got == body, f"{where}: handed back {got[:80]!r}... ({len(got)} bytes), " \
                            f"not the {len(body)}-byte body"

    for i in range(0, len(splits), 8):
        await asyncio.gather(*(one(c) for c in splits[i:i + 8]))


@rule("P13", "ResponseStreaming", PROTOCOL,
      "A streamed (SSE) answer reaches the client intact and as it is produced: the first "
      "event arrives well before the worker has finished.",
      _STREAMING)
async def check_response_streaming(ctx: Context) -> None:
    payload = ctx.body("stream", stream=True,
                       conformance={"chunks": 8, "delay_ms": 150, "response_bytes": 100_000})
    t0 = time.monotonic()
    first = None
    body = bytearray()
    hdrs = {"content-type": "application/json", **ctx.hint_headers()}
    async with ctx.session.post(ctx.envoy.url + COMPLETIONS, data=orjson.dumps(payload),
                                headers=hdrs) as r:
        assert r.status == 200, f"streamed request: HTTP {r.status}"
        sha = r.headers.get(BODY_SHA_HEADER)
        async for chunk in r.content.iter_any():
            if first is None and chunk:
                first = time.monotonic() - t0
            body += chunk
    total = time.monotonic() - t0
    assert sha == hashlib.sha256(bytes(body)).hexdigest(), "streamed body altered"
    assert body.count(b"data: ") == 8 + 2, "events missing"
    assert first is not None and first < total - 0.6, (
        f"first bytes after {first:.2f}s of {total:.2f}s: the response was buffered")


_GIE_2988 = issue(
    "https://github.com/kubernetes-sigs/gateway-api-inference-extension/issues/2988",
    "When a request body exceeds ~1MB in FULL_DUPLEX_STREAMED mode, Envoy occasionally "
    "delivers a duplicate RequestBody message with EndOfStream=true ... BadRequest - failed to "
    "parse request body: invalid character 'd' after top-level value")
_ENVOY_46237 = issue("https://github.com/envoyproxy/envoy/issues/46237",
                     "Envoy can re-deliver the final RequestBody chunk (with end_of_stream=true)"
                     " after the ext_proc server has already received and processed an "
                     "end_of_stream=true chunk (1.35+)")


@rule("R06", "DuplicateEndOfStream", REFERENCE,
      "A duplicate end-of-stream body chunk after the first is ignored: no second routing, no "
      "refusal, nothing more handed back (direct client); and 1.2 MB bodies through Envoy "
      "arrive intact (the size at which Envoy >= 1.35 duplicates).",
      _GIE_2988, _ENVOY_46237,
      epp("pkg/epp/handlers/server.go", "L305-348",
          "the reference EPP parses at every end_of_stream, with no guard against a second"),
      feature="DuplicateEndOfStream")
async def check_duplicate_eos(ctx: Context) -> None:
    body = orjson.dumps(ctx.body("duplicate end of stream " + "data " * 40))
    head, tail = body[:100], body[100:]
    ex = await ctx.wire.exchange(
        [wire.request_headers(hint=ctx.base_hint), wire.request_body(head, False),
         wire.request_body(tail, True)],
        ([wire.request_body(tail, True)], None))
    assert not ex.error, f"stream error after the duplicate: {ex.error}"
    assert ex.immediate is None, (f"refused after the duplicate: {ex.immediate.status.code} "
                                  f"{ex.immediate.body[:200]!r}")
    answers = ex.of("request_headers")
    assert len(answers) == 1, f"{len(answers)} request-headers answers (routed again)"
    first, _ = ex.body()
    everything, _ = ex.body(to_end=False)
    assert first == body, f"handed back {len(first)} bytes, not the {len(body)}-byte body"
    assert everything == body, (f"after the duplicate, {len(everything) - len(body)} more bytes "
                                "were handed back")
    for i in range(4):
        await _body_intact(ctx, ctx.body(f"big {i} " + "x" * 1_200_000))


@rule("R01", "BadBody400", REFERENCE,
      "A body the EPP cannot parse (not JSON; JSON without a model) is answered 400 by the "
      "EPP; no worker is contacted.",
      epp("pkg/epp/handlers/server.go", "L319-323",
          "errcommon.Error{Code: errcommon.BadRequest, Msg: parseErr.Error()}"),
      epp("pkg/epp/requestcontrol/director.go", "L244-247", "model not found in request body"),
      epp("pkg/common/error/error.go", "L62-98", "BadRequest → ImmediateResponse 400"),
      feature="BadRequest400")
async def check_bad_body(ctx: Context) -> None:
    before = ctx.hits()
    r = await ctx.post(data=b"{oops", headers={"content-type": "application/json"})
    expect_refused(r, 400, "malformed JSON")
    r = await ctx.post({"prompt": "no model"})
    expect_refused(r, 400, "body without model")
    assert ctx.hits() == before, "a worker was contacted"


@rule("X02", "BodyOverLimit413", EXTENSION,
      "A body over the EPP's limit (--max-body-bytes, 8 MiB by default) is answered 413 by the "
      "EPP; no worker is contacted. (The reference full EPP has no limit; the lightweight one "
      "ends the stream with ResourceExhausted past 10 MB, which Envoy turns into a 500.)",
      Source("docs/epp.md (Errors)", repo="CachePilot", quote="413 body over --max-body-bytes"),
      epp("pkg/lwepp/handlers/server.go", "L194-197", "codes.ResourceExhausted past 10 MB"))
async def check_body_over_limit(ctx: Context) -> None:
    before = ctx.hits()
    raw = orjson.dumps(ctx.body("x" * (ctx.cfg.max_body_bytes + 1024)))
    try:
        r = await ctx.post(data=raw, headers={"content-type": "application/json"})
    except aiohttp.ClientError as exc:  # the answer came while the body was still going out
        raise AssertionError(f"the connection failed before an answer: {exc}") from None
    expect_refused(r, 413, f"{len(raw)}-byte body")
    assert ctx.hits() == before, "a worker was contacted"
