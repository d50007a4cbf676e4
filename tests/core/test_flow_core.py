"""Flow control's pure core: hold, bands, fair shares, bounded locality, bounds, SLO."""

from __future__ import annotations

import math

import pytest

from cachepilot.core import InferenceRequest, Router, WorkerMetrics
from cachepilot.core.decision import Candidate, Decision
from cachepilot.core.flow import info as fi
from cachepilot.core.flow.classify import FlowMeta, classify, header_names
from cachepilot.core.flow.config import FlowConfig, parse_flow
from cachepilot.core.flow.control import FlowControl, FlowError, _holder_gain
from cachepilot.core.flow.fair import Counters
from cachepilot.core.flow.gate import CLOSED, Gate, batch_size, queued
from cachepilot.core.flow.queue import CANCELLED, DISPATCHED, REFUSED, Ticket
from cachepilot.core.predictor import TTFTPredictor
from cachepilot.core.request import RequestError
from cachepilot.core.workers import WorkerSnapshot

from helpers.routers import WORKERS, make_router

DOC = "a shared system prompt about gateways and caches. " * 60  # ~750 tokens
OTHER_DOC = "another system prompt, of the same size, about engines. " * 55


def req(text: str = "hello", doc: str = "", max_tokens: int = 16) -> InferenceRequest:
    return InferenceRequest(model="m", prompt=doc + text, max_tokens=max_tokens)


def load(router: Router, now: float, waiting: dict[str, int] | int, running: int = 3) -> None:
    """Scrape results: ``waiting`` per worker (or for all), every request this router's; a
    batch of 4 with ``running`` in it (the default gate, depth 0, opens a worker with a free
    place: one running request less than the batch and nothing waiting)."""
    pool = router.pools["default"]
    for w in WORKERS:
        n = waiting if isinstance(waiting, int) else waiting.get(w, 0)
        pool.workers[w].inflight = n + running
        pool.update_metrics(w, WorkerMetrics(waiting=n, running=running, kv_usage=0.1,
                                             max_batch=4, scraped_at=now))


def finish(router: Router, d: Decision) -> None:
    router.first_token(d, 50.0)
    router.release(d)


def flow(router: Router | None = None, **cfg: object) -> tuple[Router, FlowControl]:
    router = router or make_router()
    fc = FlowControl(router, FlowConfig(**cfg))  # type: ignore[arg-type]
    router.add_plugin(fc.plugin)
    return router, fc


def test_a_free_pool_routes_at_once_and_records_it() -> None:
    _, fc = flow()
    d = fc.admit(req(), FlowMeta("acme"), 100.0)
    assert isinstance(d, Decision)
    assert d.flow is not None and d.flow.dispatch == fi.DIRECT and d.flow.held_ms == 0
    assert d.flow.tenant == "acme" and fc.held == 0


def test_a_full_pool_holds_and_dispatches_when_a_worker_opens() -> None:
    router, fc = flow()
    load(router, 100.0, 1)  # every worker at the gate's depth
    done: list[Ticket] = []
    t = fc.admit(req(), FlowMeta("acme"), 100.0, on_done=done.append)
    assert isinstance(t, Ticket) and t.reason == fi.POOL_FULL and fc.held == 1
    assert fc.pump(100.5) == 0  # nothing opened
    load(router, 101.0, {WORKERS[1]: 0, WORKERS[0]: 1, WORKERS[2]: 1})
    assert fc.pump(101.0) == 1
    assert done == [t] and t.state == DISPATCHED
    d = t.decision
    assert d is not None and d.chosen == WORKERS[1]
    assert d.flow is not None and d.flow.held_ms == pytest.approx(1000.0)
    assert d.flow.hold_reason == fi.POOL_FULL
    closed = {c.worker for c in d.candidates if c.filtered == "closed"}
    assert closed == {WORKERS[0], WORKERS[2]}


def test_higher_bands_dispatch_first() -> None:
    router, fc = flow()
    load(router, 100.0, 1)
    low = fc.admit(req("low"), FlowMeta("a", priority=0), 100.0)
    high = fc.admit(req("high"), FlowMeta("b", priority=5), 100.1)
    assert isinstance(low, Ticket) and isinstance(high, Ticket)
    load(router, 101.0, {WORKERS[0]: 0, WORKERS[1]: 1, WORKERS[2]: 1})
    fc.pump(101.0)
    assert high.state == DISPATCHED and low.state != DISPATCHED


def test_a_light_tenant_overtakes_a_flood() -> None:
    router, fc = flow(bend_tokens=0.0, lookahead=1)
    load(router, 100.0, 1)
    flood = [fc.admit(req(f"f{i}"), FlowMeta("flood"), 100.0 + i * 0.01) for i in range(20)]
    light = fc.admit(req("l"), FlowMeta("light"), 100.5)
    # The flood has been served before: its counter is ahead of the light tenant's.
    q = fc.queues["default"]
    q.counters.charge((0, "flood"), 50_000, 100.5)
    load(router, 101.0, {WORKERS[0]: 0, WORKERS[1]: 1, WORKERS[2]: 1})
    fc.pump(101.0)
    assert isinstance(light, Ticket) and light.state == DISPATCHED
    assert all(isinstance(t, Ticket) and t.state != DISPATCHED for t in flood)


def test_two_backlogged_tenants_stay_within_the_bend_bound() -> None:
    """Tenants a and b are backlogged; a's requests all hit the open worker's cache, b's
    never do. Locality prefers a, but only until a is bend_tokens ahead."""
    bend = 3000.0
    router, fc = flow(bend_tokens=bend, lookahead=8, half_life_s=0.0, ttl_s=1000.0)
    load(router, 99.0, 0)
    warm = fc.admit(req("warm", doc=DOC), FlowMeta("a"), 99.0)
    assert isinstance(warm, Decision)
    finish(router, warm)
    holder = warm.chosen
    tickets = []
    load(router, 100.0, 1)
    for i in range(30):
        tickets.append(fc.admit(req(f"a{i}", doc=DOC, max_tokens=8), FlowMeta("a"),
                                100.0 + i * 1e-3))
        tickets.append(fc.admit(req(f"b{i}", doc=OTHER_DOC, max_tokens=8), FlowMeta("b"),
                                100.0 + i * 1e-3))
    q = fc.queues["default"]
    spread, served = [], []
    for k in range(40):
        now = 101.0 + k
        load(router, now, {w: (0 if w == holder else 1) for w in WORKERS})
        assert fc.pump(now, limit=1) == 1
        d = next(t.decision for t in tickets if t.state == DISPATCHED and t.decision
                 and t.decision.flow.held_ms == pytest.approx((now - t.enqueued) * 1000))
        served.append(d.flow.tenant)
        finish(router, d)
        band = q.bands.get(0)
        if band is not None and len(band.tenants) == 2:  # the bound holds while both wait
            spread.append(abs(q.counters.value((0, "a"), now)
                              - q.counters.value((0, "b"), now)))
    biggest = max(t.cost for t in tickets)
    assert max(spread) <= bend + biggest
    assert len(spread) > 20 and served.count("b") >= 15  # fairness kept b served…
    assert any(t.decision and t.decision.flow.dispatch == fi.LOCALITY  # …locality bent it
               for t in tickets)


def test_locality_prefers_the_request_an_open_worker_holds() -> None:
    router, fc = flow(bend_tokens=1e9)
    load(router, 99.0, 0)
    warm = fc.admit(req("warm", doc=DOC), FlowMeta("a"), 99.0)
    assert isinstance(warm, Decision)
    finish(router, warm)
    load(router, 100.0, 1)
    cold = fc.admit(req("cold " * 50), FlowMeta("b"), 100.0)
    hot = fc.admit(req("hot", doc=DOC), FlowMeta("c"), 100.1)
    load(router, 101.0, {w: (0 if w == warm.chosen else 1) for w in WORKERS})
    fc.pump(101.0, limit=1)
    assert isinstance(hot, Ticket) and hot.state == DISPATCHED
    assert isinstance(cold, Ticket) and cold.state != DISPATCHED
    assert hot.decision is not None and hot.decision.flow.dispatch == fi.LOCALITY
    assert hot.decision.flow.gain_ms > 0 and hot.decision.chosen == warm.chosen


def held_for_its_holder(router: Router, fc: FlowControl) -> tuple[str, Ticket]:
    """A document's first request routed and answered; its second, at 100.0, held for that
    busy worker (the others idle): (the holder, the held ticket)."""
    load(router, 99.0, 0)
    warm = fc.admit(req("warm", doc=DOC * 12), FlowMeta("a"), 99.0)
    assert isinstance(warm, Decision)
    finish(router, warm)
    router.pools["default"].typical_uncached = 100  # others' queued requests are short
    load(router, 100.0, {warm.chosen: 1})
    t = fc.admit(req("again", doc=DOC * 12), FlowMeta("a"), 100.0)
    assert isinstance(t, Ticket) and t.reason == fi.HOLDER_BUSY and t.holder == warm.chosen
    return warm.chosen, t


def test_waiting_for_a_busy_prefix_holder_then_going_to_it() -> None:
    router, fc = flow()
    holder, t = held_for_its_holder(router, fc)
    assert fc.next_deadline(100.0) == pytest.approx(t.holder_until)
    load(router, 100.2, {})  # the holder opens
    fc.pump(100.2)
    assert t.state == DISPATCHED and t.decision is not None
    assert t.decision.chosen == holder and t.decision.flow.dispatch == fi.HOLDER


def test_a_wait_for_a_busy_holder_teaches_the_predictor_what_waiting_takes() -> None:
    """A request held for its busy holder never queues in the engine, so the decision that
    sends it there (the holder free) cannot show the wait. The predictor learns it from the
    holder as priced when the hold began (a request queued ahead) and the TTFT plus the time
    held; the decision's own prediction is still what its accuracy scores."""
    router, fc = flow()
    predictor = TTFTPredictor()
    router.add_plugin(predictor)
    holder, t = held_for_its_holder(router, fc)
    at_hold = t.holder_priced
    assert at_hold is not None and at_hold.worker == holder and at_hold.queued >= 1
    load(router, 100.2, {})  # the holder frees
    fc.pump(100.2)
    d = t.decision
    assert d is not None and d.chosen == holder and d.winner.queued == 0
    assert d.holder_priced is at_hold and d.holder_waited_ms == pytest.approx(200.0)
    fit = predictor.pooled["default"]
    before = fit.n  # the document's first request taught it once
    router.first_token(d, 50.0)
    assert fit.n == before + 1
    row = (fit.n - 1) % len(fit.ys)
    assert fit.xs[row][3] == at_hold.queued and fit.xs[row][1] > 0
    assert fit.ys[row] == pytest.approx(250.0 - at_hold.kv_ms)
    errors = predictor.accuracy()["workers"][holder]
    assert errors["n"] == before + 1


def test_a_request_sent_at_once_is_learned_from_its_own_decision() -> None:
    router, fc = flow()
    predictor = TTFTPredictor()
    router.add_plugin(predictor)
    d = fc.admit(req(), FlowMeta("a"), 100.0)
    assert isinstance(d, Decision) and d.holder_priced is None
    router.first_token(d, 40.0)
    assert predictor.pooled["default"].ys[0] == pytest.approx(40.0 - d.winner.kv_ms)


def test_a_holder_wait_lasts_while_waiting_can_still_pay() -> None:
    """The wait ends at the break-even (the open worker's predicted TTFT less the holder's
    own time for the request), not when the predicted gain has passed: a holder that frees
    later than its queue said still gets the request (on real one-slot workers the gain
    alone sent requests away ~0.2 s before their holder freed, to a full cold prefill)."""
    router, fc = flow()
    holder, t = held_for_its_holder(router, fc)
    gain_s, wait_s = t.holder_gain_ms / 1000.0, t.holder_until - 100.0
    assert gain_s > 0 and gain_s + 0.01 < wait_s <= 5.0
    later = 100.0 + (gain_s + wait_s) / 2  # the gain has passed, the holder is still busy
    load(router, later, {holder: 1})
    assert fc.pump(later) == 0 and t.state != DISPATCHED
    load(router, later + 0.001, {})  # it frees before the break-even
    fc.pump(later + 0.001)
    assert t.decision is not None and t.decision.chosen == holder
    assert t.decision.flow.dispatch == fi.HOLDER


def test_a_holder_is_waited_for_when_a_miss_costs_later_arrivals_more_than_the_wait() -> None:
    """Measured on real one-slot llama.cpp workers (dev seeds): the holder's first token
    predicted 214 ms later than a cold prefill on the idle worker, but that prefill (3.5 s)
    is priced at 1.4 s more delay to the next arrivals there than a hit: the router's value
    picked the holder, and flow control must wait for it on the same price, not send the
    request to the miss because its first token alone comes sooner."""
    holder = Candidate("h", WorkerSnapshot("h"), filtered=CLOSED, matched_tokens=640,
                       queue_ms=3414.0, predicted_ttft_ms=3743.0, congestion_ms=166.0,
                       value=-3909.0)
    idle = Candidate("i", WorkerSnapshot("i"), predicted_ttft_ms=3529.0, congestion_ms=1433.0,
                     value=-4962.0)
    d = Decision(id="x", time=0.0, pool="p", model="m", policy="priced", weights={}, seq=0,
                 tokens=678, block_size=16, hashes=(), candidates=[idle, holder], chosen="i",
                 margin_ms=0.0, reason="")
    wait = _holder_gain(d)
    assert wait.holder == "h" and wait.priced is holder
    assert wait.gain_ms == pytest.approx(4962.0 - 3909.0)
    # The break-even: the miss's price less the holder's own once free (its queue out).
    assert wait.break_even_ms == pytest.approx(4962.0 - (3909.0 - 3414.0))
    assert FlowControl._holder_wait_s(FlowConfig(), 0, wait) == pytest.approx(4.467)
    # Where the router's value prefers the open worker, nothing is waited for.
    holder.value = -5000.0
    assert _holder_gain(d).holder is None


def test_a_holder_that_moved_is_waited_for_past_the_break_even() -> None:
    """The break-even passed with the holder still busy, but its queue has gone since the
    hold began (a full batch with nothing waiting: about to free): the request waits on and
    gets its hit (on real one-slot workers the break-even alone sent one to a cold prefill
    80 ms before its holder freed). A holder whose queue has not moved is not waited for
    past the break-even (the next test and the bound's)."""
    router, fc = flow()
    holder, t = held_for_its_holder(router, fc)
    assert t.holder_priced is not None and t.holder_priced.queue_ms > 0
    late = t.holder_until + 0.01
    load(router, late, {})  # the others open; the holder's batch full, nothing queued
    pool = router.pools["default"]
    pool.workers[holder].inflight = 4
    pool.update_metrics(holder, WorkerMetrics(waiting=0, running=4, kv_usage=0.1, max_batch=4,
                                              scraped_at=late))
    assert fc.pump(late) == 0 and t.state != DISPATCHED and t.holder_until > late
    load(router, late + 0.05, {})  # it frees
    fc.pump(late + 0.05)
    assert t.decision is not None and t.decision.chosen == holder
    assert t.decision.flow.dispatch == fi.HOLDER


def test_a_holder_that_did_not_move_is_left_at_the_break_even() -> None:
    router, fc = flow()
    holder, t = held_for_its_holder(router, fc)
    late = t.holder_until + 0.01
    load(router, late, {holder: 1})  # the same queue as when the hold began
    fc.pump(late)
    assert t.decision is not None and t.decision.chosen != holder
    assert t.decision.flow.dispatch == fi.HOLDER_TIMEOUT


def test_a_holder_wait_is_bounded() -> None:
    router, fc = flow(holder_wait_ms=300.0)
    holder, t = held_for_its_holder(router, fc)
    assert t.holder_until <= 100.3 + 1e-9
    load(router, 100.2, {holder: 1})
    assert fc.pump(100.2) == 0
    load(router, 100.4, {holder: 1})
    fc.pump(100.4)
    assert t.state == DISPATCHED and t.decision is not None
    assert t.decision.chosen != holder and t.decision.flow.dispatch == fi.HOLDER_TIMEOUT


def test_time_to_live_then_429_with_retry_after() -> None:
    router, fc = flow(ttl_s=2.0)
    load(router, 100.0, 1)
    t = fc.admit(req(), FlowMeta("a"), 100.0)
    assert isinstance(t, Ticket)
    load(router, 101.9, 1)
    fc.pump(101.9)
    assert t.state != REFUSED
    load(router, 102.1, 1)
    fc.pump(102.1)
    assert t.state == REFUSED and isinstance(t.error, FlowError)
    assert t.error.status == 429 and t.error.reason == fi.TTL_EXPIRED
    assert 1 <= (t.error.retry_after_s or 0) <= 2


def test_503_only_when_no_worker_is_ready() -> None:
    router, fc = flow(ttl_s=1.0)
    pool = router.pools["default"]
    load(router, 100.0, 1)
    t = fc.admit(req(), FlowMeta("a"), 100.0)
    assert isinstance(t, Ticket)
    for w in WORKERS:
        pool.set_ready(w, False)
    fc.pump(101.5)
    assert t.state == REFUSED and t.error is not None and t.error.status == 503
    with pytest.raises(RequestError) as exc:
        fc.admit(req(), FlowMeta("a"), 102.0)
    assert exc.value.status == 503


def test_a_full_band_pushes_out_the_tenant_holding_most_of_it() -> None:
    router, fc = flow(max_queued=5)
    load(router, 100.0, 1)
    flood = [fc.admit(req(f"f{i}"), FlowMeta("flood"), 100.0) for i in range(5)]
    light = fc.admit(req("l"), FlowMeta("light"), 100.1)
    assert isinstance(light, Ticket)
    newest = flood[-1]
    assert isinstance(newest, Ticket) and newest.state == REFUSED
    assert isinstance(newest.error, FlowError) and newest.error.reason == fi.OVER_SHARE
    with pytest.raises(FlowError) as exc:  # the flood's own newcomer is refused
        fc.admit(req("f5"), FlowMeta("flood"), 100.2)
    assert exc.value.reason == fi.QUEUE_FULL and exc.value.status == 429


def test_sheddable_requests_are_shed_when_they_would_wait() -> None:
    router, fc = flow()
    d = fc.admit(req(), FlowMeta("batch", priority=-1), 100.0)
    assert isinstance(d, Decision)  # a free pool serves it
    load(router, 100.0, 1)
    critical = fc.admit(req(), FlowMeta("ops", priority=10), 100.0)
    assert isinstance(critical, Ticket)  # held
    with pytest.raises(FlowError) as exc:
        fc.admit(req(), FlowMeta("batch", priority=-1), 100.1)
    assert exc.value.reason == fi.SHEDDABLE and exc.value.status == 429


def test_a_client_leaving_leaves_the_queue_at_once() -> None:
    router, fc = flow()
    load(router, 100.0, 1)
    t = fc.admit(req(), FlowMeta("a"), 100.0)
    assert isinstance(t, Ticket)
    fc.cancel(t, 100.1)
    assert t.state == CANCELLED and fc.held == 0


def test_slo_routes_to_a_worker_predicted_to_meet_it() -> None:
    router, fc = flow()
    load(router, 100.0, 0)
    pool = router.pools["default"]
    # Worker 0 has a long prefill queue ahead: slow; the others are idle.
    pool.workers[WORKERS[0]].pending_prefill_tokens = 100_000
    pool.workers[WORKERS[1]].pending_prefill_tokens = 100_000
    d = fc.admit(req(), FlowMeta("a", slo_ms=500.0), 100.0)
    assert isinstance(d, Decision) and d.chosen == WORKERS[2]
    assert d.flow is not None and d.flow.slo_met is True
    for w in WORKERS:
        pool.workers[w].pending_prefill_tokens = 100_000
    late = fc.admit(req(), FlowMeta("a", slo_ms=500.0), 100.1)
    assert isinstance(late, Decision) and late.flow is not None and late.flow.slo_met is False
    with pytest.raises(FlowError) as exc:
        fc.admit(req(), FlowMeta("b", priority=-1, slo_ms=500.0), 100.2)
    assert exc.value.reason == fi.SLO_UNMEETABLE


def test_completions_correct_the_charge() -> None:
    _, fc = flow(half_life_s=0.0)
    d = fc.admit(req(max_tokens=100), FlowMeta("a"), 100.0)
    assert isinstance(d, Decision) and d.flow is not None
    q = fc.queues["default"]
    charged = q.counters.value((0, "a"), 100.0)
    assert charged == pytest.approx(d.flow.charged_tokens)
    fc.settle("default", d.flow, 10, 101.0)
    assert q.counters.value((0, "a"), 101.0) == pytest.approx(charged - 2 * 90)


def test_counters_decay_and_lift() -> None:
    c = Counters(half_life_s=10.0)
    c.charge("a", 1000.0, 0.0)
    assert c.value("a", 10.0) == pytest.approx(500.0)
    c.lift("b", 400.0, 10.0)
    assert c.value("b", 10.0) == pytest.approx(400.0)
    c.lift("a", 100.0, 10.0)  # never lowered
    assert c.value("a", 10.0) == pytest.approx(500.0)


def test_classify_reads_the_extension_headers() -> None:
    cfg = FlowConfig()
    meta = classify({"x-gateway-inference-fairness-id": "acme",
                     "x-gateway-inference-objective": "batch"}, cfg, {"batch": -3})
    assert meta == FlowMeta("acme", -3, "batch") and meta.sheddable
    assert classify({"x-claude-code-session-id": "s1"}, cfg).tenant == "s1"
    assert classify({"x-cachepilot-priority": "7", "x-cachepilot-ttft-slo-ms": "250"},
                    cfg) == FlowMeta("default", 7, None, 250.0)
    assert classify({"x-gateway-inference-objective": "unknown"}, cfg).priority == 0
    with pytest.raises(RequestError):
        classify({"x-cachepilot-priority": "high"}, cfg)
    with pytest.raises(RequestError):
        classify({"x-cachepilot-ttft-slo-ms": "-1"}, cfg)
    assert "x-llm-d-inference-fairness-id" in header_names(cfg)


def test_parse_flow_settings() -> None:
    assert parse_flow("hold_depth=3, ttl_s=2.5,fairness=fcfs") == {
        "hold_depth": 3, "ttl_s": 2.5, "fairness": "fcfs"}
    for bad in ("hold_depth=1.5", "nope=1", "ttl_s=x"):
        with pytest.raises(ValueError):
            parse_flow(bad)
    with pytest.raises(ValueError):
        FlowConfig(fairness="random")
    assert math.isinf(FlowControl(make_router()).next_deadline(0.0))


def test_workers_past_the_admission_limit_refuse_at_once() -> None:
    """Holding is for busy workers; engines with 128 waiting (someone else's flood, or
    metrics that say so) get the admission limit's 429 at once, as without flow control."""
    router, fc = flow()
    load(router, 100.0, 200)
    with pytest.raises(RequestError) as exc:
        fc.admit(req(), FlowMeta("a"), 100.0)
    assert exc.value.status == 429 and exc.value.code == "overloaded" and fc.held == 0


def test_a_pool_with_flow_control_off_routes_as_before() -> None:
    router = make_router(flow=FlowConfig(enabled=False))
    _, fc = flow(router)
    load(router, 100.0, 1)  # busy, not full: flow control would hold
    d = fc.admit(req(), FlowMeta("a"), 100.0)
    assert isinstance(d, Decision) and d.flow is None


def test_without_a_batch_size_the_gate_reads_the_queue_less_what_finished() -> None:
    router = make_router()  # nobody said the batch size
    pool = router.pools["default"]
    w, cost = pool.workers[WORKERS[0]], pool.spec.cost
    w.inflight = 2
    pool.update_metrics(WORKERS[0], WorkerMetrics(waiting=2, running=5, kv_usage=0.1,
                                                  scraped_at=100.0))
    assert queued(w, 100.0, cost) == 2 and WORKERS[0] in Gate(0).split(pool, 100.0)[1]
    w.inflight = 1  # one of ours finished: the queue it was in (or ahead of) moved
    assert queued(w, 100.1, cost) == 1 and WORKERS[0] in Gate(0).split(pool, 100.1)[0]
    assert w.batch_cap_seen == 5 and batch_size(w, cost) == 0  # learned, never trusted
