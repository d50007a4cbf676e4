from collections import Counter

import pytest

from cachepilot.core import InferenceRequest, RequestError, WorkerMetrics
from cachepilot.core.cost import CostModel, parse_cost
from cachepilot.core.lifecycle import Outcome

from helpers.routers import WORKERS, make_router

DOC = "shared system prompt " * 400  # ~8k chars, 125 blocks


def req(suffix: str = "", prefix: str = DOC, model: str = "m") -> InferenceRequest:
    return InferenceRequest(model=model, prompt=prefix + suffix)


def test_same_prefix_returns_to_the_worker_that_holds_it() -> None:
    r = make_router()
    first = r.route(req("a"), 100.0)
    r.first_token(first)  # its prefill is done: no queue ahead on that worker
    r.release(first)
    second = r.route(req("b"), 100.0)
    assert second.chosen == first.chosen
    assert second.winner.matched_blocks > 100 and second.winner.saved_ms > 0
    assert second.predicted_hit


def test_every_candidate_is_priced_and_the_winner_has_the_best_value() -> None:
    r = make_router()
    first = r.route(req("a"), 100.0)
    d = r.route(req("b"), 100.0)
    assert {c.worker for c in d.candidates} == set(WORKERS)
    assert d.winner.value == max(c.value for c in d.candidates)
    holder = next(c for c in d.candidates if c.worker == first.chosen)
    cold = [c for c in d.candidates if c.worker != first.chosen]
    # What the cache holds is prefill the holder skips: its prefill term shrinks by as much
    # as its saved term grows, and a cold worker saves nothing.
    assert all(c.saved_ms == 0 and c.matched_tokens == 0 for c in cold)
    assert holder.saved_ms > 0
    assert holder.prefill_ms + holder.saved_ms == pytest.approx(cold[0].prefill_ms)
    # The holder's own first request is still in prefill there: it queues ahead.
    assert holder.queue_ms > cold[0].queue_ms


def test_new_prefixes_spread_instead_of_herding() -> None:
    r = make_router()
    chosen = Counter()
    for i in range(90):
        d = r.route(req(prefix=f"unique prompt {i} " * 50), 100.0)
        r.first_token(d)
        r.release(d)
        chosen[d.chosen] += 1
    assert len(chosen) == 3 and min(chosen.values()) >= 15


def test_hot_prefix_spills_once_its_worker_queues() -> None:
    r = make_router()
    first = r.route(req("0"), 100.0)
    r.first_token(first)
    pool = r.pools["default"]
    pool.update_metrics(first.chosen, WorkerMetrics(waiting=3, running=8, scraped_at=100.0))
    d = r.route(req("1"), 100.0)
    assert d.chosen != first.chosen  # 3 queued × 150 ms > 8k-token prefill saved (~160 ms)
    holder = next(c for c in d.candidates if c.worker == first.chosen)
    assert holder.saved_ms > 0 and holder.queue_ms > holder.saved_ms


def test_overlap_only_ignores_queues() -> None:
    r = make_router("overlap_only")
    first = r.route(req("0"), 100.0)
    r.pools["default"].update_metrics(first.chosen, WorkerMetrics(waiting=50, running=64,
                                                                  scraped_at=100.0))
    assert r.route(req("1"), 100.0).chosen == first.chosen


def test_round_robin_and_least_loaded() -> None:
    r = make_router("round_robin")
    assert [r.route(req(), 100.0).chosen for _ in range(6)] == sorted(WORKERS) * 2
    r = make_router("least_loaded")
    pool = r.pools["default"]
    pool.update_metrics(WORKERS[0], WorkerMetrics(waiting=2, running=4, scraped_at=100.0))
    pool.update_metrics(WORKERS[1], WorkerMetrics(waiting=0, running=1, scraped_at=100.0))
    pool.update_metrics(WORKERS[2], WorkerMetrics(waiting=0, running=3, scraped_at=100.0))
    assert r.route(req(), 100.0).chosen == WORKERS[1]


def test_stale_metrics_mean_saturated_never_idle() -> None:
    r = make_router()
    pool = r.pools["default"]
    pool.update_metrics(WORKERS[0], WorkerMetrics(scraped_at=100.0 - 60))  # a minute old
    d = r.route(req(), 100.0)
    stale = next(c for c in d.candidates if c.worker == WORKERS[0])
    assert not stale.eligible and stale.filtered == "stale" and stale.kv_usage == 1.0
    for w in WORKERS:
        pool.update_metrics(w, WorkerMetrics(scraped_at=0.0))
    with pytest.raises(RequestError) as exc:
        r.route(req(), 100.0)
    assert exc.value.status == 429


def test_no_ready_worker_is_503_and_all_full_is_429_with_retry_after() -> None:
    r = make_router()
    pool = r.pools["default"]
    for w in WORKERS:
        pool.set_ready(w, False)
    with pytest.raises(RequestError) as exc:
        r.route(req(), 100.0)
    assert exc.value.status == 503
    for w in WORKERS:
        pool.set_ready(w, True)
        pool.update_metrics(w, WorkerMetrics(waiting=500, running=64, scraped_at=100.0))
    with pytest.raises(RequestError) as exc:
        r.route(req(), 100.0)
    assert exc.value.status == 429 and exc.value.retry_after_s >= 1


def test_unknown_model_is_404_when_every_pool_names_its_models() -> None:
    r = make_router(models=("llama",))
    assert r.route(req(model="llama"), 100.0)
    with pytest.raises(RequestError) as exc:
        r.route(req(model="gpt"), 100.0)
    assert exc.value.status == 404 and "llama" in exc.value.message


def test_kv_pressure_steers_away_from_a_full_cache() -> None:
    r = make_router()
    pool = r.pools["default"]
    pool.update_metrics(WORKERS[0], WorkerMetrics(kv_usage=0.99, num_blocks=1000,
                                                  scraped_at=100.0))
    for _ in range(20):
        d = r.route(req(prefix="", suffix="new"), 100.0)
        assert d.chosen != WORKERS[0]
        r.release(d)
    c = next(c for c in d.candidates if c.worker == WORKERS[0])
    assert c.kv_ms > 500


def test_release_and_first_token_are_idempotent_bookkeeping() -> None:
    r = make_router()
    d = r.route(req(), 100.0)
    w = r.pools["default"].workers[d.chosen]
    assert w.inflight == 1 and w.pending_prefill_tokens == d.tokens
    r.first_token(d)
    r.first_token(d)
    assert w.pending_prefill_tokens == 0
    r.release(d)
    r.release(d)
    assert w.inflight == 0


def test_a_vacated_request_frees_its_worker_once_and_reports_its_outcome_later() -> None:
    """Envoy ended the request, its outcome comes a batch later: the worker is free (and the
    prefill over) at once, the release then decrements nothing twice."""
    r = make_router()
    d = r.route(req(), 100.0)
    w = r.pools["default"].workers[d.chosen]
    r.vacate(d, 100.5)
    r.vacate(d, 100.6)  # once
    assert w.inflight == 0 and w.pending_prefill_tokens == 0 and w.freed_at == 100.5
    assert not d.finished
    other = r.route(req(), 100.5)
    assert other.chosen == d.chosen  # priced without it: its holder is free again
    r.release(d, Outcome(completed_at=100.7))
    assert d.finished and w.inflight == 1  # only `other` is left on it
    r.release(other)
    assert w.inflight == 0


def test_removed_worker_gets_nothing() -> None:
    r = make_router()
    d = r.route(req(), 100.0)
    r.pools["default"].remove_worker(d.chosen)
    for i in range(10):
        assert r.route(req(str(i)), 100.0).chosen != d.chosen


def test_heterogeneous_workers_under_unit_weights_go_to_the_lowest_predicted_ttft() -> None:
    """Per-worker learned models (one worker 4× slower at prefill, one with a slow base):
    with unit weights the pick is always the lowest predicted TTFT, whatever holds the
    prefix (the old priced value, saved − queue − kv, chose 192.9 ms over 103.0 ms here)."""
    from cachepilot.core.workers import TTFTParams

    r = make_router()
    pool = r.pools["default"]
    pool.workers[WORKERS[0]].ttft = TTFTParams(15.0, 0.32, 0.2, 50.0)  # slow prefill, cached
    pool.workers[WORKERS[1]].ttft = TTFTParams(80.0, 0.04, 0.2, 50.0)  # fast prefill, slow base
    pool.directory.insert(WORKERS[0], r.fingerprint(req("x"), pool).hashes[:60])
    old_would_differ = 0
    for i in range(30):
        pool.update_metrics(WORKERS[2], WorkerMetrics(waiting=i % 4, running=i % 9,
                                                      scraped_at=100.0, kv_usage=0.1))
        d = r.decide(pool, "m", r.fingerprint(req(str(i)), pool), 100.0, f"d{i}")
        best = min(c.predicted_ttft_ms for c in d.candidates)
        assert d.winner.congestion_ms == 0.0  # nothing routed yet: no arrival rate
        assert d.winner.predicted_ttft_ms <= best + 0.5  # the tie tolerance
        old = max(d.candidates, key=lambda c: c.saved_ms - c.queue_ms - c.kv_ms)
        old_would_differ += old.worker != d.chosen
    assert old_would_differ > 0
    cached = next(c for c in d.candidates if c.worker == WORKERS[0])
    assert cached.matched_blocks == 60 and cached.saved_ms > 0


def test_a_recompute_on_a_backlogged_worker_is_priced_for_everyone_behind_it() -> None:
    """Congestion: the prefill a placement adds delays every request that reaches that worker
    before it catches up, so the same recompute costs more where a backlog waits. With a
    prefix held by a busy worker, the recompute on an idle worker wins; on a worker two
    requests behind it still gives the lower TTFT for this request, but no longer wins."""
    from cachepilot.core.cost import CostModel, congestion_ms_of

    cost = CostModel()
    lam = 20.0 / 3 / 1000.0  # 20 req/s over three workers, per ms
    idle = congestion_ms_of(200.0, lam, 0.0, cost)
    behind = congestion_ms_of(200.0, lam, 600.0, cost)
    assert idle == pytest.approx(lam * 200.0 * 100.0)
    assert behind == pytest.approx(lam * 200.0 * 700.0) and behind > 6 * idle

    r = make_router()
    pool = r.pools["default"]
    fp = r.fingerprint(req("doc"), pool)
    pool.directory.insert(WORKERS[0], fp.hashes)
    for i in range(40):  # an arrival rate to price against
        pool.note_arrival(100.0 + i * 0.05, 2000)
    now = 102.0

    def decide(waiting_elsewhere: int) -> tuple[str, bool]:
        pool.update_metrics(WORKERS[0], WorkerMetrics(waiting=4, running=8, scraped_at=now))
        for w in WORKERS[1:]:
            pool.update_metrics(w, WorkerMetrics(waiting=waiting_elsewhere, running=8,
                                                 scraped_at=now))
        d = r.decide(pool, "m", fp, now, "d")
        holder = d.candidates[0]
        return d.chosen, min(d.candidates, key=lambda c: c.predicted_ttft_ms) is holder

    assert decide(0)[0] != WORKERS[0]  # an idle worker: recomputing there is cheap for all
    chosen, holder_fastest = decide(2)
    assert chosen == WORKERS[0] and not holder_fastest


def test_a_busy_slot_is_a_full_batch_and_a_newcomer_queues_for_it() -> None:
    """llama.cpp says how many slots it has: with every slot running, a request waits for
    one to free up (admission, priced per queued request), not just for a prefill."""
    r = make_router()
    pool = r.pools["default"]
    for w in WORKERS:
        pool.update_metrics(w, WorkerMetrics(waiting=0, running=1 if w == WORKERS[0] else 0,
                                             slots=1, scraped_at=100.0))
    d = r.decide(pool, "m", r.fingerprint(req("a"), pool), 100.0, "d")
    waits = {c.worker: (c.queued, c.batch_waits) for c in d.candidates}
    assert waits[WORKERS[0]] == (0, 1)  # its own place behind the busy slot
    assert all(waits[w] == (0, 0) for w in WORKERS[1:])
    assert d.chosen != WORKERS[0]


def test_a_full_batch_of_known_size_makes_every_place_in_line_wait_for_a_sequence() -> None:
    """A batch engine whose batch size is known (WorkerMetrics.max_batch): with the batch
    full, the waiting requests and the newcomer each wait for a finishing sequence as well as
    for admission (priced apart, ms_per_batch_wait); below it, or with the size unknown, for
    admission only."""
    r = make_router()
    pool = r.pools["default"]
    metrics = {WORKERS[0]: WorkerMetrics(waiting=2, running=4, max_batch=4, scraped_at=100.0),
               WORKERS[1]: WorkerMetrics(waiting=2, running=3, max_batch=4, scraped_at=100.0),
               WORKERS[2]: WorkerMetrics(waiting=2, running=4, scraped_at=100.0)}
    for w, m in metrics.items():
        pool.update_metrics(w, m)
    d = r.decide(pool, "m", r.fingerprint(req("a"), pool), 100.0, "d")
    waits = {c.worker: (c.queued, c.batch_waits) for c in d.candidates}
    assert waits == {WORKERS[0]: (2, 3), WORKERS[1]: (2, 0), WORKERS[2]: (2, 0)}
    by = {c.worker: c for c in d.candidates}
    assert by[WORKERS[0]].queue_ms == pytest.approx(
        by[WORKERS[2]].queue_ms + 3 * CostModel().full_batch_wait_ms)
    assert d.chosen != WORKERS[0]


def test_cost_overrides_keep_integer_parameters_whole() -> None:
    """``--cost max_batch=128`` is the integer 128 for every command that takes it; a
    fraction for an integer parameter is an error, never truncated."""
    assert parse_cost("max_batch=128,base_ttft_ms=3") == {"max_batch": 128, "base_ttft_ms": 3.0}
    assert isinstance(parse_cost("admission_limit=4.0")["admission_limit"], int)
    with pytest.raises(ValueError, match="whole number"):
        parse_cost("max_batch=1.5")
