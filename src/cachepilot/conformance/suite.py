"""The endpoint picker conformance rules, one check each, run through a real Envoy
configured as the reference gateway configures an EPP (:mod:`cachepilot.conformance.envoy`)
in front of fake workers (:mod:`cachepilot.conformance.workers`). Black box: the EPP under
test is only an address; it must have been told the workers' addresses (and serve the
suite's model names) before the run. docs/epp.md lists the rules and where each comes from.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import orjson
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cachepilot.conformance.envoy import METADATA_HOST, SuiteEnvoy
from cachepilot.conformance.workers import BODY_SHA_HEADER, WORKER_HEADER, FakeWorker
from cachepilot.gateway.protocol import (
    MODEL_REWRITE_HEADER,
    SERVED_REPORT_HEADER,
    SUBSET_KEY,
)

MODEL = "conformance-fake-model"  # the upstream conformance tests' model name
REWRITE_TARGET = "conformance-fake-model-v2"
UNKNOWN_MODEL = "conformance-no-such-model"
COMPLETIONS = "/v1/completions"
_UUIDISH = re.compile(r"^[0-9A-Za-z][0-9A-Za-z._-]{7,}$")


@dataclass
class SuiteConfig:
    epp: tuple[str, int]  # the EPP under test (gRPC ext_proc)
    workers: list[tuple[str, int]]  # where the fake workers listen (the EPP knows them)
    model: str = MODEL
    rewrite_target: str = REWRITE_TARGET
    unknown_model: str = UNKNOWN_MODEL
    ready_timeout_s: float = 30.0
    # Recheck budget for rules that wait for the EPP to notice a change (saturation, down).
    settle_timeout_s: float = 10.0
    only: tuple[str, ...] = ()  # rule names to run (empty: all)


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)

    @property
    def worker(self) -> str:
        return self.headers.get(WORKER_HEADER, "")

    def seen(self) -> dict[str, Any]:
        """What the worker received (the fake worker's echo)."""
        data = self.json()
        assert isinstance(data, dict) and "conformance" in data, \
            f"not a fake worker's answer (status {self.status}): {self.body[:200]!r}"
        return data["conformance"]


@dataclass
class Context:
    cfg: SuiteConfig
    envoy: SuiteEnvoy
    workers: list[FakeWorker]
    session: aiohttp.ClientSession

    @property
    def addresses(self) -> list[str]:
        return [w.address for w in self.workers]

    def body(self, prompt: str = "Write as if you were a critic: San Francisco",
             **extra: Any) -> dict[str, Any]:
        return {"model": self.cfg.model, "prompt": prompt, "max_tokens": 4, **extra}

    @contextlib.asynccontextmanager
    async def envoy_without_epp(self, mode: str) -> AsyncIterator[str]:
        """A second Envoy, fail-open or fail-closed, whose EPP is unreachable: its URL."""
        envoy = SuiteEnvoy(self.cfg.epp, self.addresses, down=mode)
        try:
            await envoy.start()
            yield envoy.url
        finally:
            envoy.stop()

    async def post(self, payload: Any = None, *, data: Any = None, path: str = COMPLETIONS,
                   host: str | None = None, subset: str | None = None,
                   headers: dict[str, str] | None = None, base: str = "") -> Reply:
        hdrs = dict(headers or {})
        if host:
            hdrs["Host"] = host
        if subset is not None:
            hdrs[SUBSET_KEY] = subset
        if payload is not None:
            data = orjson.dumps(payload)
            hdrs.setdefault("content-type", "application/json")
        async with self.session.post((base or self.envoy.url) + path, data=data,
                                     headers=hdrs) as r:
            return Reply(r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read())

    async def get(self, path: str, base: str = "") -> Reply:
        async with self.session.get((base or self.envoy.url) + path) as r:
            return Reply(r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read())

    def hits(self) -> int:
        return sum(w.hits for w in self.workers)


Check = Callable[[Context], Awaitable[None]]


@dataclass(frozen=True)
class Rule:
    name: str
    text: str  # the rule, as the protocol or the reference EPP states it
    source: str  # where it comes from
    check: Check
    required: bool = True  # False: the reference does not require it (an extension)


RULES: list[Rule] = []
_PROTOCOL = "docs/proposals/004-endpoint-picker-protocol/README.md"
_SERVER = "pkg/epp/handlers/server.go"


def rule(text: str, source: str, required: bool = True) -> Callable[[Check], Check]:
    def add(fn: Check) -> Check:
        RULES.append(Rule(fn.__name__.removeprefix("check_"), text, source, fn, required))
        return fn
    return add


def _expect(reply: Reply, status: int, what: str) -> None:
    assert reply.status == status, (f"{what}: expected HTTP {status}, got {reply.status}: "
                                    f"{reply.body[:300]!r}")


# -- destination --------------------------------------------------------------------------------
@rule("The destination header x-gateway-destination-endpoint names the picked endpoint; "
      "a proxy routing on the header alone (ORIGINAL_DST) reaches it.", _PROTOCOL)
async def check_destination_header(ctx: Context) -> None:
    for i in range(len(ctx.workers)):
        r = await ctx.post(ctx.body(f"header {i}"))
        _expect(r, 200, "request through the header-routed cluster")
        seen = r.seen()
        assert r.worker in ctx.addresses, f"served by {r.worker!r}, not a pool worker"
        assert seen["destination"] == r.worker, (
            f"the worker {r.worker} got x-gateway-destination-endpoint "
            f"{seen['destination']!r}")


@rule("The same endpoint is set in dynamic metadata envoy.lb/x-gateway-destination-endpoint: "
      "a proxy routing on the metadata alone reaches the endpoint the header names (the two "
      "never differ).", _PROTOCOL)
async def check_destination_metadata(ctx: Context) -> None:
    # Without metadata this cluster falls back to round robin: over several requests the
    # worker would differ from the header's pick.
    for i in range(3 * len(ctx.workers)):
        r = await ctx.post(ctx.body(f"metadata {i}"), host=METADATA_HOST)
        _expect(r, 200, "request through the metadata-routed cluster")
        head = r.seen()["destination"]
        assert head.split(",")[0] == r.worker, (
            f"metadata routed to {r.worker}, the header named {head!r}")


# -- subset hint --------------------------------------------------------------------------------
@rule("With envoy.lb.subset_hint/x-gateway-destination-endpoint-subset set, only the listed "
      "endpoints are candidates.", _PROTOCOL)
async def check_subset_hint_respected(ctx: Context) -> None:
    for w in ctx.addresses * 2:
        r = await ctx.post(ctx.body(f"subset {w}"), subset=w)
        _expect(r, 200, f"request with subset {w}")
        assert r.worker == w, f"subset hint {w} but served by {r.worker}"
    pair = ",".join(ctx.addresses[:2])
    for i in range(4):
        r = await ctx.post(ctx.body(f"pair {i}"), subset=pair)
        _expect(r, 200, f"request with subset {pair}")
        assert r.worker in ctx.addresses[:2], f"subset hint {pair} but served by {r.worker}"


@rule("A subset hint with no eligible endpoint is answered 503 (ImmediateResponse); no "
      "worker is contacted.", _PROTOCOL)
async def check_subset_none_eligible_503(ctx: Context) -> None:
    before = ctx.hits()
    r = await ctx.post(ctx.body("nowhere"), subset="192.0.2.1:9")  # TEST-NET-1: no pod
    _expect(r, 503, "subset naming no pool endpoint")
    assert ctx.hits() == before, "a worker was contacted"


# -- errors -------------------------------------------------------------------------------------
@rule("A request body that cannot be parsed is answered 400.", f"{_SERVER} (BadRequest)")
async def check_bad_body_400(ctx: Context) -> None:
    before = ctx.hits()
    r = await ctx.post(data=b"{oops", headers={"content-type": "application/json"})
    _expect(r, 400, "malformed JSON")
    r = await ctx.post({"prompt": "no model"})
    _expect(r, 400, "body without model")
    assert ctx.hits() == before, "a worker was contacted"


@rule("A model the pool does not serve is answered 404 (CachePilot; the reference EPP has no "
      "model list and routes it).", "CachePilot README (errors)", required=False)
async def check_unknown_model_404(ctx: Context) -> None:
    r = await ctx.post({**ctx.body("who"), "model": ctx.cfg.unknown_model})
    _expect(r, 404, f"model {ctx.cfg.unknown_model!r}")


# -- request id ---------------------------------------------------------------------------------
@rule("A client's x-request-id reaches the worker unchanged.", f"{_SERVER} (x-request-id)")
async def check_request_id_preserved(ctx: Context) -> None:
    rid = "conformance-request-id-0001"
    r = await ctx.post(ctx.body("rid"), headers={"x-request-id": rid})
    _expect(r, 200, "request with x-request-id")
    assert r.seen()["x-request-id"] == rid, f"worker got x-request-id {r.seen()['x-request-id']!r}"


@rule("A request without x-request-id gets one generated by the EPP (this Envoy does not "
      "generate it), and the worker receives it.", f"{_SERVER} (uuid.NewString)")
async def check_request_id_generated(ctx: Context) -> None:
    ids = set()
    for i in range(2):
        r = await ctx.post(ctx.body(f"no rid {i}"))
        _expect(r, 200, "request without x-request-id")
        rid = r.seen()["x-request-id"]
        assert _UUIDISH.match(rid or ""), f"worker got x-request-id {rid!r}"
        ids.add(rid)
    assert len(ids) == 2, "two requests got the same generated x-request-id"


# -- served endpoint ----------------------------------------------------------------------------
@rule("The EPP reads who served the response (envoy.lb/x-gateway-destination-endpoint-served "
      "on the response) and reports it (x-conformance-test-served-endpoint, as the reference "
      "lightweight EPP).", f"{_PROTOCOL}; pkg/lwepp/handlers/response.go")
async def check_served_endpoint_reported(ctx: Context) -> None:
    for w in ctx.addresses:
        r = await ctx.post(ctx.body(f"served {w}"), subset=w)
        _expect(r, 200, f"request with subset {w}")
        got = r.headers.get(SERVED_REPORT_HEADER)
        assert got == r.worker == w, (f"served by {r.worker}, the EPP reported {got!r}")


# -- bodies -------------------------------------------------------------------------------------
async def _body_intact(ctx: Context, payload: dict[str, Any], chunked: bool = False) -> None:
    raw = orjson.dumps(payload)
    if chunked:
        async def pieces() -> AsyncIterator[bytes]:
            for i in range(0, len(raw), 50_000):
                yield raw[i:i + 50_000]
        r = await ctx.post(data=pieces(), headers={"content-type": "application/json"})
    else:
        r = await ctx.post(data=raw, headers={"content-type": "application/json"})
    _expect(r, 200, f"{len(raw)}-byte request")
    seen = r.seen()
    assert seen["body_bytes"] == len(raw), f"worker got {seen['body_bytes']} of {len(raw)} bytes"
    assert seen["body_sha256"] == hashlib.sha256(raw).hexdigest(), "body altered on the way"
    assert r.headers.get(BODY_SHA_HEADER) == hashlib.sha256(r.body).hexdigest(), \
        "response body altered on the way"


@rule("A small request body reaches the worker byte for byte (FULL_DUPLEX_STREAMED: the EPP "
      "sends the body back itself).", f"{_SERVER}; pkg/common/envoy/request.go")
async def check_request_body_small_intact(ctx: Context) -> None:
    await _body_intact(ctx, ctx.body("small"))


@rule("A large request body (3 MB, many chunks both ways) reaches the worker byte for byte, "
      "with a content-length that matches.", "pkg/common/envoy/chunking.go")
async def check_request_body_large_intact(ctx: Context) -> None:
    await _body_intact(ctx, ctx.body("large " + "lorem ipsum " * 250_000))


@rule("A chunked request body (no content-length, 1 MB) reaches the worker byte for byte.",
      "pkg/common/envoy/chunking.go")
async def check_request_body_chunked_intact(ctx: Context) -> None:
    await _body_intact(ctx, ctx.body("chunked " + "dolor sit " * 100_000), chunked=True)


@rule("A large response body (2 MB) reaches the client byte for byte.",
      "pkg/common/envoy/response.go")
async def check_response_body_large_intact(ctx: Context) -> None:
    await _body_intact(ctx, ctx.body("big answer", conformance={"response_bytes": 2_000_000}))


@rule("A streamed (SSE) response reaches the client intact and as it is produced: the "
      "first event arrives before the worker has finished.", f"{_SERVER} (modelServerStreaming)")
async def check_response_streaming(ctx: Context) -> None:
    payload = ctx.body("stream", stream=True,
                       conformance={"chunks": 8, "delay_ms": 150, "response_bytes": 100_000})
    t0 = time.monotonic()
    first = None
    body = bytearray()
    async with ctx.session.post(ctx.envoy.url + COMPLETIONS, data=orjson.dumps(payload),
                                headers={"content-type": "application/json"}) as r:
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


# -- model rewrite ------------------------------------------------------------------------------
@rule("x-gateway-model-name-rewrite: the worker gets the body's model rewritten to the "
      "header's value (and a matching content-length); the client sees its own model name in "
      "the answer.", "pkg/epp/requestcontrol/director.go (mutateModel); "
                     f"{_SERVER} (rewriteModelName)")
async def check_model_rewrite(ctx: Context) -> None:
    target = ctx.cfg.rewrite_target
    for stream in (False, True):
        r = await ctx.post(ctx.body("rewrite", stream=stream),
                           headers={MODEL_REWRITE_HEADER: target})
        _expect(r, 200, f"rewritten request (stream={stream})")
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


# -- requests without a body --------------------------------------------------------------------
@rule("A request without a body (GET /v1/models) is answered at the headers and sent to a "
      "pool endpoint.", "pkg/epp/handlers/request.go (EndOfStream in headers)")
async def check_bodyless_request(ctx: Context) -> None:
    r = await ctx.get("/v1/models")
    _expect(r, 200, "GET /v1/models")
    assert r.worker in ctx.addresses, f"served by {r.worker!r}"


# -- EPP unavailable ----------------------------------------------------------------------------
@rule("EPP unreachable, failureMode FailClose (failure_mode_allow false): the request fails "
      "with a 5xx and no worker is contacted.", "api/v1/inferencepool_types.go (FailureMode)")
async def check_epp_down_fail_closed(ctx: Context) -> None:
    async with ctx.envoy_without_epp("closed") as url:
        before = ctx.hits()
        r = await ctx.post(ctx.body("closed"), base=url)
        assert 500 <= r.status < 600, f"expected a 5xx, got {r.status}"
        assert ctx.hits() == before, "a worker was contacted"


@rule("EPP unreachable, failureMode FailOpen (failure_mode_allow true): a request the proxy "
      "had not yet streamed to the EPP (no body: GET /v1/models) still reaches a worker. "
      "(Envoy 1.40 cannot fail open once a FULL_DUPLEX_STREAMED body went to the EPP: a POST "
      "then gets 500; docs/epp.md.)", "conformance/tests/epp_unavailable_fail_open.go")
async def check_epp_down_fail_open(ctx: Context) -> None:
    async with ctx.envoy_without_epp("open") as url:
        r = await ctx.get("/v1/models", base=url)
        _expect(r, 200, "GET with the EPP unreachable")
        assert r.worker in ctx.addresses, f"served by {r.worker!r}"


# -- health -------------------------------------------------------------------------------------
@rule("The EPP serves the gRPC health protocol: liveness, readiness and "
      "envoy.service.ext_proc.v3.ExternalProcessor are SERVING.", f"{_PROTOCOL} (Health)")
async def check_health_services(ctx: Context) -> None:
    host, port = ctx.cfg.epp
    async with grpc.aio.insecure_channel(f"{host}:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING, \
                f"{service}: {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}"


# -- load shedding and no endpoint (the suite changes the workers' state) -------------------------
async def _until(ctx: Context, check: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + ctx.cfg.settle_timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"{what} not seen in {ctx.cfg.settle_timeout_s}s"
        await asyncio.sleep(0.1)


async def _status_is(ctx: Context, status: int) -> bool:
    """The probe's status is ``status`` and no worker answered it (the fake workers answer
    503 themselves when down)."""
    r = await ctx.post(ctx.body("probe"))
    return r.status == status and (status == 200 or not r.worker)


@rule("Every endpoint saturated (metrics: a huge queue, a full KV cache): the request is "
      "shed with 429 (the reference sheds only sheddable requests, priority < 0).",
      f"{_PROTOCOL} (429); pkg/epp/requestcontrol/admission.go", required=False)
async def check_saturated_429(ctx: Context) -> None:
    for w in ctx.workers:
        w.saturated = True
    try:
        await _until(ctx, lambda: _status_is(ctx, 429), "429 from a saturated pool")
    finally:
        for w in ctx.workers:
            w.saturated = False
    await _until(ctx, lambda: _status_is(ctx, 200), "recovery after saturation")


@rule("No ready endpoint (every worker's metrics and health fail): 503.",
      f"{_PROTOCOL} (503)", required=False)
async def check_no_ready_endpoint_503(ctx: Context) -> None:
    for w in ctx.workers:
        w.down = True
    try:
        await _until(ctx, lambda: _status_is(ctx, 503), "503 with every worker down")
        before = ctx.hits()
        r = await ctx.post(ctx.body("down"))
        # A worker answering 503 itself would contact it: the EPP must answer.
        _expect(r, 503, "request with every worker down")
        assert ctx.hits() == before, "a down worker was contacted"
    finally:
        for w in ctx.workers:
            w.down = False
    await _until(ctx, lambda: _status_is(ctx, 200), "recovery after the workers came back")


# -- the run ------------------------------------------------------------------------------------
@dataclass
class Result:
    name: str
    passed: bool
    required: bool
    seconds: float
    detail: str = ""
    text: str = ""


@dataclass
class Report:
    results: list[Result] = field(default_factory=list)
    error: str = ""  # the suite could not run (Envoy, workers, EPP never ready)

    @property
    def passed(self) -> bool:
        """Every required rule passed."""
        return not self.error and all(r.passed for r in self.results if r.required)

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "error": self.error,
                "results": [r.__dict__ for r in self.results]}


async def _wait_ready(ctx: Context) -> None:
    """Until the EPP routes (it may need to find the workers first)."""
    deadline = time.monotonic() + ctx.cfg.ready_timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            r = await ctx.post(ctx.body("ready?"))
            if r.status == 200:
                return
            last = f"HTTP {r.status}: {r.body[:200]!r}"
        except aiohttp.ClientError as exc:
            last = str(exc)
        await asyncio.sleep(0.2)
    raise RuntimeError(f"the EPP did not route a request in {ctx.cfg.ready_timeout_s}s "
                       f"(last: {last})")


async def run_suite(cfg: SuiteConfig) -> Report:
    """Start the workers and Envoy, wait for the EPP, run every rule (in order), stop."""
    rules = [r for r in RULES if not cfg.only or r.name in cfg.only]
    report = Report()
    workers = [FakeWorker(h, p) for h, p in cfg.workers]
    envoy = SuiteEnvoy(cfg.epp, [w.address for w in workers])
    try:
        for w in workers:
            await w.start()
        await envoy.start()
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as session:
            ctx = Context(cfg, envoy, workers, session)
            await _wait_ready(ctx)
            for r in rules:
                t0 = time.monotonic()
                try:
                    await r.check(ctx)
                    res = Result(r.name, True, r.required, 0.0, text=r.text)
                except AssertionError as exc:
                    res = Result(r.name, False, r.required, 0.0, str(exc), r.text)
                except Exception as exc:  # a broken answer fails the rule, not the run
                    res = Result(r.name, False, r.required, 0.0,
                                 f"{type(exc).__name__}: {exc}", r.text)
                res.seconds = round(time.monotonic() - t0, 3)
                report.results.append(res)
    except (OSError, RuntimeError) as exc:
        report.error = str(exc)
    finally:
        envoy.stop()
        for w in workers:
            await w.stop()
    return report
