"""Rules that change the workers' state (run after the others): no ready endpoint, a
saturated pool, and two pools behind one gateway, each with its own EPP and state."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from cachepilot.conformance.envoy import POOL_B_HOST
from cachepilot.conformance.rules import (
    EXTENSION,
    PROTOCOL,
    Context,
    canonical,
    endpoints,
    expect,
    expect_refused,
    refused,
    rule,
)
from cachepilot.conformance.sources import Source, epp, issue, proto
from cachepilot.conformance.workers import FakeWorker

_NO_READY = proto("L79", "ImmediateResponse with 503 (Serivce Unavailable) HTTP status code if "
                         "there are no ready endpoints.")
_DROP = proto("L80", "ImmediateResponse with 429 (Too Many Requests) HTTP status code if the "
                     "request should be dropped (e.g., a Sheddable request, and the servers "
                     "under heavy load).")


@contextlib.asynccontextmanager
async def _changed(ctx: Context, workers: list[FakeWorker], host: str | None = None,
                   **state: bool) -> AsyncIterator[None]:
    """The workers in ``state`` for the block; then back, and wait until the EPP routes
    again (part of the rule, unless the block already failed it)."""
    ctx.set_state(workers, **state)
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        ctx.set_state(workers, **{k: False for k in state})

        async def routes() -> bool:
            r = await ctx.post(ctx.body("recovered?"), host=host, hint=None)
            return r.status == 200
        try:
            await ctx.until(routes, "routing again after the workers recovered")
        except AssertionError:
            if not failed:
                raise


@rule("P09", "NoReadyEndpoint503", PROTOCOL,
      "With every endpoint of the pool down (health and metrics failing), the EPP answers "
      "503 itself (an ImmediateResponse, no worker contacted) once it has noticed; it routes "
      "again when they recover. (How an EPP learns readiness is its own: the fake workers fail "
      "/health and /metrics, and refuse inference with 503.)",
      _NO_READY,
      epp("pkg/epp/requestcontrol/director.go", "L190-196",
          "failed to find endpoint candidates for serving the request → ServiceUnavailable"),
      mutates=True)
async def check_no_ready(ctx: Context) -> None:
    async with _changed(ctx, ctx.workers, down=True):
        async def noticed() -> bool:
            return refused(await ctx.post(ctx.body("probe"), hint=None), 503)
        await ctx.until(noticed, "a 503 from the EPP with every worker down")
        before = ctx.hits()
        for i in range(3):
            r = await ctx.post(ctx.body(f"down {i}"), hint=None)
            expect_refused(r, 503, "request with every worker down")
        assert ctx.hits() == before, "a down worker was contacted"


@rule("P10", "DropIs429", PROTOCOL,
      "With every endpoint saturated (metrics: a long queue, a full KV cache), each request "
      "without a subset hint is either routed to a pool endpoint or dropped with 429 by the "
      "EPP (an ImmediateResponse) — never another status. Whether to drop is the EPP's to "
      "decide. (With a hint, 503 is also right: none of the listed endpoints is eligible.)",
      _DROP,
      epp("pkg/epp/requestcontrol/admission.go", "L64-84",
          "system saturated, sheddable request dropped → ResourceExhausted (429)"),
      mutates=True)
async def check_drop_is_429(ctx: Context) -> None:
    replies = []
    async with _changed(ctx, ctx.workers, saturated=True):
        end = time.monotonic() + ctx.cfg.saturation_window_s
        while time.monotonic() < end:
            replies.append(await ctx.post(ctx.body("saturated"), hint=None))
    for r in replies:
        if r.status == 200:
            assert r.worker in ctx.addresses, f"200 from {r.worker!r}, not a pool worker"
        else:
            expect_refused(r, 429, "request to a saturated pool")


@rule("X03", "SaturatedPool429", EXTENSION,
      "CachePilot sheds when every endpoint is full, whatever the request's priority: a "
      "saturated pool gets 429 within the settle time, then 200 again. (The reference sheds "
      "only sheddable requests, priority < 0.)",
      Source("docs/epp.md (Errors)", repo="CachePilot", quote="429 every endpoint full"),
      epp("pkg/epp/util/request/sheddable.go", "", "return priority < 0"),
      mutates=True)
async def check_saturated_429(ctx: Context) -> None:
    async with _changed(ctx, ctx.workers, saturated=True):
        async def shed() -> bool:
            return refused(await ctx.post(ctx.body("probe"), hint=None), 429)
        await ctx.until(shed, "a 429 from a saturated pool")


@rule("P15", "PoolsScoped", PROTOCOL,
      "Two pools behind one gateway, each with its own EPP: each EPP names only its own pool's "
      "endpoints; with every endpoint of the second pool down, its requests get its EPP's 503 "
      "while the first pool's requests are still served.",
      proto("L44", "If the key `x-gateway-destination-endpoint-subset` is not set, then the "
                   "EPP MUST select from the set defined by the `InferencePool` selector."),
      proto("L75", "The ordered endpoint list is scoped to the selected `InferencePool` backend "
                   "for which the EPP was invoked."),
      _NO_READY,
      issue("https://github.com/istio/istio/issues/61594",
            "Two InferencePools in one HTTPRoute rule share a single endpoint picker, and an "
            "empty member 503s the whole rule"),
      needs=("pool_b",), mutates=True)
async def check_pools_scoped(ctx: Context) -> None:
    pools = {"A": ({canonical(w.address) for w in ctx.workers}, None),
             "B": ({canonical(w.address) for w in ctx.workers_b}, POOL_B_HOST)}
    for name, (pool, host) in pools.items():
        for i in range(8):
            r = await ctx.post(ctx.body(f"pool {name} {i}"), host=host, hint=None)
            expect(r, 200, f"request to pool {name}")
            header, meta = r.destinations()
            for e in endpoints(header) + endpoints(meta):
                assert canonical(e) in pool, f"pool {name}'s EPP named {e!r}"
            assert canonical(r.worker) in pool, f"pool {name}'s request reached {r.worker}"
    async with _changed(ctx, ctx.workers_b, POOL_B_HOST, down=True):
        async def b_refused() -> bool:
            return refused(await ctx.post(ctx.body("b?"), host=POOL_B_HOST, hint=None), 503)
        await ctx.until(b_refused, "a 503 from pool B's EPP with its workers down")
        for i in range(4):
            r = await ctx.post(ctx.body(f"B down {i}"), host=POOL_B_HOST, hint=None)
            expect_refused(r, 503, "request to pool B, all down")
            r = await ctx.post(ctx.body(f"A while B down {i}"), hint=None)
            expect(r, 200, "request to pool A while pool B is down")
            assert canonical(r.worker) in pools["A"][0], f"pool A's request reached {r.worker}"
