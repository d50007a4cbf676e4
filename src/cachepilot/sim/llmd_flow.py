"""A model of the llm-d router's flow control, for the flow-control study: its own gate,
pickers, pacing and bounds, on the core's queue (the study compares schedulers, and this is
someone else's, not a second copy of ours).

Read from ``llm-d/llm-d-router`` at ``ebab687927f5331c1b39defcb579a07951bce56c`` (2026-08-22;
docs/flow-control.md has the notes):

* The gate, ``utilization-detector`` (``pkg/epp/framework/plugins/flowcontrol/
  saturationdetector/utilization/detector.go``): saturation is the pool's *mean* over
  endpoints of ``max(waiting / 5, kv_usage / 0.8)`` from the last metrics refresh, an
  endpoint whose metrics are older than 200 ms counting 1.0; nothing is dispatched while it
  is ≥ 1.0 (the static usage limit's ceiling), whatever the band. Below it, every endpoint
  is a candidate and the scheduler picks one afterwards (late binding): here the priced
  router, so the study isolates the queueing.
* Pacing (``pkg/epp/flowcontrol/controller/internal/processor.go``, ``dispatchCycle``): one
  request per dispatch cycle, a cycle per 1 ms tick and one per arrival.
* Fairness: ``global-strict`` by default (the band's oldest request: one FIFO,
  ``fairness/globalstrict``), or ``program-aware`` with strategy ``las``
  (``fairness/program-aware/strategy_las.go``): score ``0.8·(1 − norm service) + 0.2·norm
  head wait`` over the band's non-empty flows, service ``1·prompt + 2·completion`` charged
  only when a request completes, decayed with a 60 s half-life.
* Bounds (``registry/config.go``, ``controller/config.go``, ``admission.go``): 5000 requests
  per band (the arrival is refused when full: no push-out, no per-tenant cap), a 60 s time
  to live enforced by a 1 s sweep, no Retry-After; sheddable requests (priority < 0) wait
  in their band like any other when flow control is on.
"""

from __future__ import annotations

import math

from cachepilot.core.decision import Decision
from cachepilot.core.flow.config import FlowConfig
from cachepilot.core.flow.control import FlowControl
from cachepilot.core.flow.fair import Counters
from cachepilot.core.flow.gate import Gate
from cachepilot.core.flow.info import QUEUE_FULL
from cachepilot.core.flow.pick import FcfsPicker, Picker, Usable
from cachepilot.core.flow.queue import Band, PoolQueue, Ticket
from cachepilot.core.lifecycle import Outcome, Plugin
from cachepilot.core.pool import Pool
from cachepilot.core.router import Router
from cachepilot.sim.flow_driver import SimFlow

QUEUE_DEPTH, KV_THRESHOLD, STALE_S = 5.0, 0.8, 0.2  # utilization detector defaults
TTL_S, SWEEP_S, BAND_CAPACITY, TICK_S = 60.0, 1.0, 5000, 0.001
LAS_SERVICE, LAS_WAIT, LAS_HALF_LIFE_S = 0.8, 0.2, 60.0

# What llm-d's defaults mean in our FlowConfig's terms: its queue bounds and TTL, no
# sheddable fast path, no prefix-holder waits (a locality gain nothing reaches).
CONFIG = FlowConfig(max_queued=BAND_CAPACITY, ttl_s=TTL_S, sheddable_ttl_s=TTL_S,
                    holder_wait_ms=0.0, lookahead=1, bend_tokens=0.0,
                    half_life_s=0.0)


class SaturationGate(Gate):
    """All ready endpoints open while the pool's mean utilization is under 1, none above."""

    def __init__(self) -> None:
        super().__init__(hold_depth=1)

    def split(self, pool: Pool, now: float) -> tuple[list[str], list[str]]:
        ready = [a for a, w in pool.workers.items() if w.ready]
        if not ready:
            return [], []
        total = 0.0
        for a in ready:
            m = pool.workers[a].metrics
            if m is None or now - m.scraped_at > STALE_S:
                total += 1.0
            else:
                total += max(m.waiting / QUEUE_DEPTH, (m.kv_usage or 0.0) / KV_THRESHOLD)
        return (ready, []) if total / len(ready) < 1.0 else ([], ready)

    def is_open(self, pool: Pool, addr: str, now: float) -> bool:
        return addr in self.split(pool, now)[0]


class LasPicker(Picker, Plugin):
    """program-aware fairness, strategy ``las``; also the plugin that charges service."""

    def __init__(self) -> None:
        self.service = Counters(LAS_HALF_LIFE_S)

    def candidates(self, q: PoolQueue, band: Band, now: float, usable: Usable) -> list[Ticket]:
        flows = list(band.tenants.items())
        served = [self.service.value(t, now) for t, _ in flows]
        waited = [now - fifo[0].enqueued for _, fifo in flows]
        ns, nw = _normalised(served), _normalised(waited)
        scores = [LAS_SERVICE * (1.0 - s) + LAS_WAIT * w for s, w in zip(ns, nw, strict=True)]
        best = max(range(len(flows)), key=lambda i: (scores[i], -flows[i][1][0].seq))
        head = flows[best][1][0]
        return [head] if usable(head) else []

    def on_finish(self, decision: Decision, outcome: Outcome) -> None:
        f = decision.flow
        if f is None:
            return
        at = outcome.completed_at if outcome.completed_at is not None else decision.time
        self.service.charge(f.tenant, decision.tokens + 2.0 * (outcome.completion_tokens or 0),
                            at)


def _normalised(xs: list[float]) -> list[float]:
    lo, hi = min(xs), max(xs)
    return [0.5] * len(xs) if hi == lo else [(x - lo) / (hi - lo) for x in xs]


class LlmdFlowControl(FlowControl):
    """llm-d's bounds on the core's queue: a full band refuses the newcomer, the time to
    live is swept once a second, an arrival runs one dispatch cycle."""

    def __init__(self, router: Router, config: FlowConfig, picker: Picker) -> None:
        super().__init__(router, config, gate=SaturationGate(), picker=picker)
        self.arrival_limit = 1

    def _make_room(self, q: PoolQueue, t: Ticket, now: float) -> None:
        band = q.bands.get(t.meta.priority)
        if band is not None and band.count >= q.config.max_queued:
            raise self._report_new(q, t.request, t.meta,
                                   self._error(q, t.meta, QUEUE_FULL, now), now)

    def deadline(self, cfg: FlowConfig, now: float, priority: int) -> float:
        return math.ceil((now + cfg.ttl(priority)) / SWEEP_S) * SWEEP_S


def llmd(fairness: str = "global-strict") -> SimFlow:
    """llm-d flow control with its defaults (``global-strict``) or with LAS fairness."""
    def build(router: Router, config: FlowConfig) -> FlowControl:
        if fairness == "las":
            picker: Picker = LasPicker()
            router.add_plugin(picker)  # type: ignore[arg-type]
        else:
            picker = FcfsPicker()
        return LlmdFlowControl(router, config, picker)

    name = "llm-d" if fairness == "global-strict" else "llm-d+LAS"
    return SimFlow(name=name, config=CONFIG, build=build, tick_s=TICK_S, limit=1)
