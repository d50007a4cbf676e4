"""The prefill in progress: what the engine reports it has already prefilled of the requests
this router sent is no longer ahead of a newcomer (llama.cpp's /slots; the simulator's
engines report the same), so a request for a document another request is still prefilling
is priced for the rest only, not the whole prefill again."""

from __future__ import annotations

from dataclasses import replace

import orjson

from cachepilot.core import InferenceRequest
from cachepilot.core.lifecycle import Outcome
from cachepilot.core.pool import Pool
from cachepilot.core.router import Router
from cachepilot.core.workers import TTFTParams, WorkerMetrics
from cachepilot.datalayer.engines import parse_prefill_progress, slots_url
from cachepilot.sim.engine import Engine, EngineConfig, EngineRequest

from helpers.routers import make_router

DOC = "a shared handbook chapter about routing " * 60


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
    r, pool = slot_router(learned=None)  # only what the engine reports counts
    first = r.route(InferenceRequest(model="m", prompt=DOC + "question 0?"), 100.0)
    holder = pool.workers[first.chosen]
    before = r.decide(pool, "m", r.fingerprint(InferenceRequest(model="m", prompt=DOC + "1?"),
                                               pool), 100.5, "x")
    ahead = {c.worker: c.ahead_tokens for c in before.candidates}[first.chosen]
    assert ahead == first.uncached_tokens  # the whole prefill still counts
    pool.update_metrics(first.chosen, replace(holder.metrics, scraped_at=100.5,
                                              prefill_done_tokens=ahead - 40))
    after = r.decide(pool, "m", r.fingerprint(InferenceRequest(model="m", prompt=DOC + "1?"),
                                              pool), 100.6, "y")
    assert {c.worker: c.ahead_tokens for c in after.candidates}[first.chosen] == 40
    r.first_token(first, 900.0)  # the report was about that request: nothing is credited
    assert holder.metrics.prefill_done_tokens == 0 and holder.pending_prefill_tokens == 0


LEARNED = TTFTParams(base_ms=100.0, prefill_ms_per_token=2.5, ms_per_running=5.0,
                     ms_per_queued=50.0, ms_per_batch_wait=800.0)


def slot_router(learned: TTFTParams | None = LEARNED) -> tuple[Router, Pool]:
    """Two one-slot workers whose TTFT models were learned (``learned``; None: not yet)."""
    r = make_router(workers=("10.0.0.1:8000", "10.0.0.2:8000"))
    pool = r.pools["default"]
    for w in pool.workers.values():
        pool.update_metrics(w.address, WorkerMetrics(scraped_at=100.0, slots=1,
                                                      slot_tokens=4096))
        w.ttft = learned
    return r, pool


def ahead_on(r: Router, pool: Pool, worker: str, now: float, text: str) -> tuple[int, int]:
    """(tokens priced ahead on ``worker``, the prefill progress its record carries), with
    the workers' last scrapes (that reported no progress) taken just now."""
    for w in pool.workers.values():
        assert w.metrics is not None
        w.metrics = replace(w.metrics, scraped_at=now)
    d = r.decide(pool, "m", r.fingerprint(InferenceRequest(model="m", prompt=text), pool),
                 now, text)
    c = next(c for c in d.candidates if c.worker == worker)
    assert c.state.metrics is not None
    return c.ahead_tokens, c.state.metrics.prefill_done_tokens


def test_a_slot_engines_prefill_drains_with_the_clock_between_its_readings() -> None:
    """The request a one-slot worker holds has been prefilling since it was sent: past the
    worker's fixed cost, at its priced rate, the queue ahead shrinks between two /slots
    readings instead of standing still; never below none, and the decision's record
    carries the progress it priced (replay prices the same queue)."""
    r, pool = slot_router()
    p = LEARNED
    first = r.route(InferenceRequest(model="m", prompt=DOC + "question 0?"), 100.0)
    whole = first.uncached_tokens
    assert ahead_on(r, pool, first.chosen, 100.0, "a") == (whole, 0)
    assert ahead_on(r, pool, first.chosen, 100.0 + p.base_ms / 1000.0, "b") == (whole, 0)
    t = 100.0 + (p.base_ms + 40.5 * p.prefill_ms_per_token) / 1000.0
    assert ahead_on(r, pool, first.chosen, t, "c") == (whole - 40, 40)
    assert ahead_on(r, pool, first.chosen, 130.0, "d") == (0, whole)
    assert pool.workers[first.chosen].metrics.prefill_done_tokens == 0  # only the record's
    r.first_token(first, 300.0)
    assert ahead_on(r, pool, first.chosen, 130.0, "e") == (0, 0)


def test_a_request_behind_a_busy_slot_starts_when_that_one_ends() -> None:
    """A second request sent to a one-slot worker still decoding the first waits for the
    slot: nothing of it is counted done until the first has ended, then from that end."""
    r, pool = slot_router()
    p = LEARNED
    first = r.route(InferenceRequest(model="m", prompt=DOC + "question 0?"), 100.0)
    r.first_token(first, 300.0)
    second = r.route(InferenceRequest(model="m", prompt="another document " * 60),
                     100.3, only=[first.chosen])
    assert ahead_on(r, pool, first.chosen, 110.0, "a") == (second.uncached_tokens, 0)
    r.release(first, Outcome(status=200, completed_at=110.0))
    t = 110.0 + (p.base_ms + 10.5 * p.prefill_ms_per_token) / 1000.0
    assert ahead_on(r, pool, first.chosen, t, "b") == (second.uncached_tokens - 10, 10)


def test_no_slot_progress_is_counted_where_someone_else_sends_work() -> None:
    """The engine has requests this router did not send (another gateway's): which one its
    slot is on is not ours to know, so only its own readings count."""
    r, pool = slot_router()
    first = r.route(InferenceRequest(model="m", prompt=DOC + "question 0?"), 100.0)
    assert ahead_on(r, pool, first.chosen, 101.0, "a")[1] > 0
    pool.update_metrics(first.chosen, WorkerMetrics(scraped_at=101.0, slots=1,
                                                    slot_tokens=4096, running=1, waiting=1))
    assert ahead_on(r, pool, first.chosen, 101.0, "b")[1] == 0


def test_no_slot_progress_is_counted_before_the_worker_has_its_own_rate() -> None:
    """The pool's prior prices a prefill ~30 times too fast for a CPU llama.cpp worker: in
    the simulator, counting progress at it called a prefill done 0.7 s after it began (of
    1.6 s) and sent the next request behind it. Until the worker's own rate is learned,
    only the engine's readings count."""
    r, pool = slot_router(learned=None)
    first = r.route(InferenceRequest(model="m", prompt=DOC + "question 0?"), 100.0)
    assert ahead_on(r, pool, first.chosen, 104.0, "a") == (first.uncached_tokens, 0)


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
