"""The prefill in progress: what the engine reports it has already prefilled of the requests
this router sent is no longer ahead of a newcomer (llama.cpp's /slots; the simulator's
engines report the same), so a request for a document another request is still prefilling
is priced for the rest only, not the whole prefill again."""

from __future__ import annotations

from dataclasses import replace

import orjson

from cachepilot.core import InferenceRequest
from cachepilot.core.workers import WorkerMetrics
from cachepilot.datalayer.engines import parse_prefill_progress, slots_url
from cachepilot.sim.engine import Engine, EngineConfig, EngineRequest

from helpers.routers import make_router


def slot(processing: bool, processed: int, decoded: int) -> dict:
    return {"id": 0, "n_ctx": 1024, "is_processing": processing, "id_task": 7,
            "n_prompt_tokens": processed + 16, "n_prompt_tokens_processed": processed,
            "n_prompt_tokens_cache": 16,
            "next_token": [{"has_next_token": True, "n_remain": 8, "n_decoded": decoded}]}


def test_slots_say_how_far_the_prompts_being_prefilled_are() -> None:
    body = orjson.dumps([slot(True, 256, 0), slot(True, 512, 3), slot(False, 900, 0),
                         {"id": 3, "n_ctx": 1024, "is_processing": False}])
    assert parse_prefill_progress(body) == 256  # decoding and idle slots are past it
    assert slots_url("http://10.0.0.1:8080/metrics") == "http://10.0.0.1:8080/slots"


def test_reported_progress_shortens_the_queue_until_that_request_answers() -> None:
    r = make_router(workers=("10.0.0.1:8000", "10.0.0.2:8000"))
    pool = r.pools["default"]
    for w in pool.workers:
        pool.update_metrics(w, WorkerMetrics(scraped_at=100.0, slots=1, slot_tokens=4096))
    doc = "a shared handbook chapter about routing " * 60
    first = r.route(InferenceRequest(model="m", prompt=doc + "question 0?"), 100.0)
    holder = pool.workers[first.chosen]
    before = r.decide(pool, "m", r.fingerprint(InferenceRequest(model="m", prompt=doc + "1?"),
                                               pool), 100.5, "x")
    ahead = {c.worker: c.ahead_tokens for c in before.candidates}[first.chosen]
    assert ahead == first.uncached_tokens  # the whole prefill still counts
    pool.update_metrics(first.chosen, replace(holder.metrics, scraped_at=100.5,
                                              prefill_done_tokens=ahead - 40))
    after = r.decide(pool, "m", r.fingerprint(InferenceRequest(model="m", prompt=doc + "1?"),
                                              pool), 100.6, "y")
    assert {c.worker: c.ahead_tokens for c in after.candidates}[first.chosen] == 40
    r.first_token(first, 900.0)  # the report was about that request: nothing is credited
    assert holder.metrics.prefill_done_tokens == 0 and holder.pending_prefill_tokens == 0


def test_an_engine_reports_only_the_steps_it_has_finished() -> None:
    e = Engine(replace(EngineConfig(), max_batched_tokens=256))
    req = EngineRequest(1, 600, (), 4, 0.0)
    e.submit(req)
    step = e.step(0.0)
    assert e.prefill_done_tokens(in_step=True) == 0  # the first batch is still running
    assert e.prefill_done_tokens() == 256
    e.step(step.end)
    assert e.prefill_done_tokens(in_step=False) == 512


def test_kv_events_show_how_far_a_chunked_prefill_has_got() -> None:
    """vLLM publishes a request's blocks as its chunked prefill computes them: the blocks
    of the routed request's uncached part the events announced are no longer ahead."""
    r = make_router(workers=("10.0.0.1:8000", "10.0.0.2:8000"))
    pool = r.pools["default"]
    for w in pool.workers:
        pool.directory.set_mode(w, "exact")
    doc = "a shared handbook chapter about routing " * 60
    first = r.route(InferenceRequest(model="m", prompt=doc + "question 0?"), 100.0)

    def ahead(now: float, i: str) -> int:
        fp = r.fingerprint(InferenceRequest(model="m", prompt=doc + i), pool)
        d = r.decide(pool, "m", fp, now, i)
        return {c.worker: c.ahead_tokens for c in d.candidates}[first.chosen]

    assert ahead(100.1, "a") == first.uncached_tokens
    half = first.hashes[: len(first.hashes) // 2]
    pool.directory.stored(first.chosen, half)
    assert ahead(100.2, "b") == first.uncached_tokens - len(half) * first.block_size
    r.first_token(first, 500.0)
    assert ahead(100.3, "c") == 0


def test_pricing_does_not_walk_the_prefills_in_flight_where_no_events_can_tell(
        monkeypatch) -> None:
    """With 150 requests in flight, pricing an approximate worker must not go through every
    pending prefill (it did, ~1.5 µs each on every decision: O(in flight)); finishing one
    takes exactly that one out of the count, in any order."""
    r = make_router(workers=("10.0.0.1:8000", "10.0.0.2:8000"))
    pool = r.pools["default"]
    routed = [r.route(InferenceRequest(model="m", prompt=f"prompt {i} " * 40), 100.0)
              for i in range(150)]
    walked: list[str] = []
    monkeypatch.setattr(pool.directory, "stored_blocks",
                        lambda w, hashes: walked.append(w) or 0)
    r.route(InferenceRequest(model="m", prompt="one more " * 40), 100.1)
    assert walked == []
    for d in routed[::2]:
        r.first_token(d, 101.0)
    assert sum(w.pending_requests for w in pool.workers.values()) == 75 + 1
    assert sum(len(p) for p in r._prefilling.values()) == 75 + 1
