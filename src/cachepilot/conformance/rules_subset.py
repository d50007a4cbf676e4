"""The subset hint: the protocol's list (one and several endpoints, the empty list, none
eligible), requests without a body, the refusals under a fail-open gateway, and the string
form the proposal does not define."""

from __future__ import annotations

from cachepilot.conformance.envoy import FAIL_OPEN_HOST
from cachepilot.conformance.rules import (
    NOWHERE,
    PROTOCOL,
    REFERENCE,
    Context,
    canonical,
    endpoints,
    expect,
    expect_refused,
    rule,
)
from cachepilot.conformance.sources import epp, issue, lwepp, proto

_HINT = proto("L32", "For each HTTP request, the data plane CAN communicate the subset of "
                     "endpoints the EPP MUST pick from by setting an unstructured entry in the "
                     "filter metadata field of the ext-proc request. The metadata entry for "
                     "the subset list MUST be wrapped with an outer key (which represents the "
                     "metadata namespace) with a default of `envoy.lb.subset_hint`.")
_LIST = proto("L34-40", 'filterMetadata: {"envoy.lb.subset_hint" {'
                        '"x-gateway-destination-endpoint-subset": [<ip:port>, <ip:port>, ...]}}')
_ONLY = proto("L42", "If the key `x-gateway-destination-endpoint-subset` is set, the EPP MUST "
                     "only select endpoints from the specified list.")
_EACH = proto("L50", "For each HTTP request, the EPP MUST communicate to the data plane one "
                     "or more selected model server endpoints")
_503 = proto("L42", "If none of the endpoints in the list is eligible or the list is empty, "
                    "then the EPP MUST return a ImmediateResponse with 503 (Service "
                    "Unavailable) HTTP status code.")


def _within(ctx: Context, r_worker: str, header: str | None, hint: list[str], what: str
            ) -> None:
    allowed = {canonical(h) for h in hint}
    assert canonical(r_worker) in allowed, f"{what}: served by {r_worker}"
    for e in endpoints(header):
        assert canonical(e) in allowed, f"{what}: the header names {header!r}"


@rule("P05", "SubsetHintList", PROTOCOL,
      "With the subset hint as the protocol's list (one endpoint, then two), the EPP names "
      "only listed endpoints and the request reaches one of them.",
      _HINT, _LIST, _ONLY)
async def check_subset_list(ctx: Context) -> None:
    for w in ctx.ipv4 * 2:
        r = await ctx.post(ctx.body(f"subset {w}"), hint=[w])
        expect(r, 200, f"request with the hint [{w}]")
        _within(ctx, r.worker, r.destinations()[0], [w], f"hint [{w}]")
    pair = ctx.ipv4[:2]
    for i in range(4):
        r = await ctx.post(ctx.body(f"pair {i}"), hint=pair)
        expect(r, 200, f"request with the hint {pair}")
        _within(ctx, r.worker, r.destinations()[0], pair, f"hint {pair}")


@rule("P06", "SubsetEmptyList503", PROTOCOL,
      "An empty list as the subset hint is answered 503 by the EPP (an ImmediateResponse: not "
      "a stream error, not a pick); no worker is contacted.",
      _LIST, _503)
async def check_subset_empty(ctx: Context) -> None:
    before = ctx.hits()
    r = await ctx.post(ctx.body("empty"), url=ctx.envoy.empty_subset_url, hint=None)
    expect_refused(r, 503, "request whose subset hint is the empty list")
    assert ctx.hits() == before, "a worker was contacted"


@rule("P07", "SubsetNoneEligible503", PROTOCOL,
      "A subset hint naming no endpoint of the pool is answered 503 by the EPP (an "
      "ImmediateResponse); no worker is contacted.",
      _503,
      proto("L78-79", "If the EPP did not communicate the server endpoint via these two "
                      "methods, it MUST return an error as follows: ImmediateResponse with 503 "
                      "(Serivce Unavailable) HTTP status code if there are no ready endpoints."))
async def check_subset_none_eligible(ctx: Context) -> None:
    before = ctx.hits()
    for hint in ([NOWHERE], [NOWHERE, "192.0.2.2:9"]):
        r = await ctx.post(ctx.body("nowhere"), hint=hint)
        expect_refused(r, 503, f"request with the hint {hint}")
    assert ctx.hits() == before, "a worker was contacted"


@rule("P08", "BodylessRequest", PROTOCOL,
      "A request without a body (GET /v1/models) is routed too: to a pool endpoint without a "
      "hint, to the listed endpoint with one, and refused 503 when the hint names none.",
      _EACH, _ONLY, _503,
      epp("pkg/epp/handlers/request.go", "L41-53",
          "the reference routes a bodyless request to a random endpoint, ignoring the hint "
          "(so it fails this rule)"))
async def check_bodyless(ctx: Context) -> None:
    r = await ctx.get("/v1/models", hint=None)
    expect(r, 200, "GET /v1/models")
    assert r.worker in ctx.addresses, f"served by {r.worker!r}"
    for w in ctx.ipv4:
        r = await ctx.get("/v1/models", hint=[w])
        expect(r, 200, f"GET /v1/models with the hint [{w}]")
        _within(ctx, r.worker, r.destinations()[0], [w], f"GET with the hint [{w}]")
    before = ctx.hits()
    r = await ctx.get("/v1/models", hint=[NOWHERE])
    expect_refused(r, 503, f"GET /v1/models with the hint [{NOWHERE}]")
    assert ctx.hits() == before, "a worker was contacted"


@rule("P16", "FailOpenRefusals", PROTOCOL,
      "Behind a fail-open gateway (InferencePool failureMode FailOpen, failure_mode_allow) the "
      "EPP still routes a streamed POST, and its refusals still refuse: a POST and a GET whose "
      "hint names no pool endpoint get its 503 and reach no worker. (Envoy lets a request "
      "through when the ext_proc stream fails before the body was sent, so a refusal that is "
      "a stream error rather than an ImmediateResponse lets the GET reach a worker.)",
      _503,
      issue("https://github.com/kubernetes-sigs/gateway-api-inference-extension/issues/1266",
            "InferencePool FailOpen Unsupported with Envoy v1.35.0 (FULL_DUPLEX_STREAMED "
            "cannot fail open once the body went to the EPP)"),
      issue("https://github.com/kubernetes-sigs/gateway-api-inference-extension/pull/3037",
            "the upstream EppUnAvailableFailOpen test passed whether or not fail-open worked"))
async def check_fail_open(ctx: Context) -> None:
    r = await ctx.post(ctx.body("fail-open"), host=FAIL_OPEN_HOST)
    expect(r, 200, "POST through the fail-open route")
    header, meta = r.destinations()
    first = endpoints(header or meta)
    assert first and canonical(first[0]) == canonical(r.worker), (
        f"the EPP named {header or meta!r}, the request reached {r.worker}")
    before = ctx.hits()
    r = await ctx.get("/v1/models", host=FAIL_OPEN_HOST, hint=[NOWHERE])
    expect_refused(r, 503, f"GET through the fail-open route with the hint [{NOWHERE}]")
    r = await ctx.post(ctx.body("fail-open nowhere"), host=FAIL_OPEN_HOST, hint=[NOWHERE])
    expect_refused(r, 503, f"POST through the fail-open route with the hint [{NOWHERE}]")
    assert ctx.hits() == before, "a worker was contacted"


@rule("R07", "SubsetHintString", REFERENCE,
      "The subset hint as one comma-separated string (what a header-to-metadata rule writes) "
      "is read as the list: one endpoint, two, and none eligible (503).",
      lwepp("pkg/lwepp/handlers/request.go", "L49-77",
            "We must support both string and []any types because different Envoy configuration "
            "pathways populate metadata differently ... Supporting both prevents silent "
            "fail-opens"),
      epp("pkg/epp/requestcontrol/candidates.go", "L113-129",
          "the full reference EPP reads only a list: a string hint is ignored and every "
          "endpoint is a candidate"),
      feature="SubsetHintString")
async def check_subset_string(ctx: Context) -> None:
    for w in ctx.ipv4:
        r = await ctx.post(ctx.body(f"string {w}"), hint=None, hint_string=w)
        expect(r, 200, f"request with the string hint {w!r}")
        _within(ctx, r.worker, r.destinations()[0], [w], f"string hint {w!r}")
    pair = ctx.ipv4[:2]
    for i in range(3):
        r = await ctx.post(ctx.body(f"string pair {i}"), hint=None, hint_string=",".join(pair))
        expect(r, 200, f"request with the string hint {','.join(pair)!r}")
        _within(ctx, r.worker, r.destinations()[0], pair, "string hint")
    before = ctx.hits()
    r = await ctx.post(ctx.body("string nowhere"), hint=None, hint_string=NOWHERE)
    expect_refused(r, 503, f"request with the string hint {NOWHERE!r}")
    assert ctx.hits() == before, "a worker was contacted"
