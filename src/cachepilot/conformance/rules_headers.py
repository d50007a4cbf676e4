"""What the reference EPP does with headers: x-request-id kept and generated, the model name
rewrite, the served endpoint echoed for the upstream conformance tests; and CachePilot's
404 for a model no pool serves."""

from __future__ import annotations

import re

import orjson

from cachepilot.conformance import wire
from cachepilot.conformance.rules import (
    EXTENSION,
    REFERENCE,
    Context,
    canonical,
    endpoints,
    expect,
    expect_refused,
    rule,
)
from cachepilot.conformance.sources import Source, epp, lwepp, proto
from cachepilot.gateway.protocol import MODEL_REWRITE_HEADER, SERVED_REPORT_HEADER

_UUIDISH = re.compile(r"^[0-9A-Za-z][0-9A-Za-z._-]{7,}$")


@rule("R02", "RequestIdKept", REFERENCE,
      "A client's x-request-id reaches the worker unchanged.",
      epp("pkg/epp/handlers/server.go", "L291-298", "reads x-request-id"),
      epp("pkg/epp/handlers/request.go", "L136-147",
          "generateHeaders copies every non-system-owned request header into the mutation"),
      feature="RequestIdPropagation")
async def check_request_id_kept(ctx: Context) -> None:
    rid = "conformance-request-id-0001"
    r = await ctx.post(ctx.body("rid"), headers={"x-request-id": rid})
    expect(r, 200, "request with x-request-id")
    got = r.seen()["x-request-id"]
    assert got == rid, f"worker got x-request-id {got!r}"


@rule("R03", "RequestIdGenerated", REFERENCE,
      "A request without x-request-id gets one from the EPP (the suite's Envoy does not "
      "generate it), distinct per request, and the worker receives it.",
      epp("pkg/epp/handlers/server.go", "L294-297",
          "if the request id is empty, uuid.NewString() is stored in the request's headers"),
      feature="RequestIdGeneration")
async def check_request_id_generated(ctx: Context) -> None:
    ids = set()
    for i in range(2):
        r = await ctx.post(ctx.body(f"no rid {i}"))
        expect(r, 200, "request without x-request-id")
        rid = r.seen()["x-request-id"]
        assert _UUIDISH.match(rid or ""), f"worker got x-request-id {rid!r}"
        ids.add(rid)
    assert len(ids) == 2, "two requests got the same generated x-request-id"


@rule("R04", "ModelNameRewrite", REFERENCE,
      "x-gateway-model-name-rewrite: the worker gets the body's model rewritten to the "
      "header's value (with a matching content-length); the client sees its own model name in "
      "the answer, streamed and not.",
      epp("pkg/epp/handlers/request.go", "L63-64", "the rewrite header sets TargetModelName"),
      epp("pkg/epp/requestcontrol/director.go", "L242-273",
          "mutateModel sets bodyMap[\"model\"]; the body is re-marshalled, its size reset"),
      epp("pkg/epp/handlers/server.go", "L370-384, L446-460",
          "rewriteModelName puts the client's name back, per chunk when streaming"),
      feature="ModelNameRewrite")
async def check_model_rewrite(ctx: Context) -> None:
    target = ctx.cfg.rewrite_target
    for stream in (False, True):
        r = await ctx.post(ctx.body("rewrite", stream=stream),
                           headers={MODEL_REWRITE_HEADER: target})
        expect(r, 200, f"rewritten request (stream={stream})")
        if stream:
            events = [orjson.loads(line[6:]) for line in r.body.split(b"\n")
                      if line.startswith(b"data: {")]
            seen = events[-1]["conformance"]
            models = {e["model"] for e in events}
        else:
            seen, models = r.seen(), {r.json()["model"]}
        got = seen["received_model"]
        assert got == target, f"worker got model {got!r}, not {target!r}"
        assert seen["content-length"] in (None, str(seen["body_bytes"])), (
            f"content-length {seen['content-length']} for a {seen['body_bytes']}-byte body")
        assert models == {ctx.cfg.model}, f"client saw model(s) {models}"


@rule("R05", "ServedEndpointEcho", REFERENCE,
      "The EPP reads who served the response (envoy.lb/x-gateway-destination-endpoint-served, "
      "which the protocol asks the data plane to report) and echoes it as "
      "x-conformance-test-served-endpoint, the upstream conformance tests' hook: the worker "
      "that answered, through Envoy; and, from a direct client, the endpoint reported even "
      "when it is not the first one picked (a retry went down the list).",
      proto("L88-97", "For each HTTP response, the data plane MUST communicate to the EPP the "
                      "endpoint that served the request ... \"x-gateway-destination-endpoint-"
                      "served\" ... with an outer key ... `envoy.lb`"),
      lwepp("pkg/lwepp/handlers/response.go", "L34-46",
            "reads envoy.lb/x-gateway-destination-endpoint-served and writes "
            "x-conformance-test-served-endpoint"),
      lwepp("conformance/tests/gateway_destination_endpoint_served.go", "",
            "GatewayDestinationEndpointServed reads the echo"),
      feature="ServedEndpointEcho")
async def check_served_echo(ctx: Context) -> None:
    for w in ctx.ipv4:
        r = await ctx.post(ctx.body(f"served {w}"), hint=[w])
        expect(r, 200, f"request with the hint [{w}]")
        got = r.headers.get(SERVED_REPORT_HEADER)
        assert got == r.worker, f"served by {r.worker}, the EPP reported {got!r}"
    reported: list[str] = []

    def report(ex: wire.Exchange) -> list:
        """A served endpoint other than the first picked, as after a retry down the list."""
        header, meta = ex.destination()
        first = {canonical(e) for e in endpoints(header or meta)[:1]}
        reported.append(next((a for a in ctx.ipv4 if canonical(a) not in first), ctx.ipv4[0]))
        return [wire.response_headers(200, reported[0])]

    ex2 = await ctx.wire.exchange(
        [wire.request_headers(hint=ctx.base_hint),
         wire.request_body(orjson.dumps(ctx.body("served, direct")), True)],
        (report, "response_headers"),
        ([wire.response_body(b'{"ok":true}', True)], "response_body"))
    assert ex2.immediate is None and not ex2.error, "the direct request was not routed"
    served = reported[0]
    got = ex2.set_headers("response_headers").get(SERVED_REPORT_HEADER)
    assert got == served, f"the data plane reported {served}, the EPP echoed {got!r}"
    # An EPP may hold the picked endpoint for unreachable after this: let it recover.
    await ctx.until(lambda: _routes_to_all(ctx), "routing to every worker after the report")


async def _routes_to_all(ctx: Context) -> bool:
    for w in ctx.ipv4:
        r = await ctx.post(ctx.body(f"after served {w}"), hint=[w])
        if r.status != 200:
            return False
    return True


@rule("X01", "UnknownModel404", EXTENSION,
      "A model no pool serves is answered 404 by the EPP (CachePilot; the reference EPP has no "
      "model list and routes it; the proposal required 404 until 5b4fbb97).",
      Source("README.md (errors)", repo="CachePilot", quote="404 model not served by any pool"),
      Source("docs/proposals/004-endpoint-picker-protocol/README.md", "5b4fbb97",
             quote="removed: 'Otherwise, the EPP MUST return a 404 status code.'"))
async def check_unknown_model(ctx: Context) -> None:
    r = await ctx.post({**ctx.body("who"), "model": ctx.cfg.unknown_model})
    expect_refused(r, 404, f"model {ctx.cfg.unknown_model!r}")
