"""The discrete-event simulator: the gateway's :class:`Router` in front of N
:class:`~cachepilot.sim.engine.Engine` instances, on a virtual clock.

Events (a heapq ordered by time, then by insertion) are request arrivals, engine step ends
and metric scrapes. An idle engine that receives a request starts a step at once; a busy one
starts its next step when the current one ends (the engine's own continuous batching decides
what runs). Scrapes copy each engine's queue, batch and KV usage into the pool as
:class:`WorkerMetrics` every ``scrape_interval_s``, so the router sees state exactly as old
as it would in the gateway; ``scrape_interval_s=0`` gives fresh metrics at every decision.

Each replica's Router runs the same lifecycle plugins as the gateway's
(:func:`cachepilot.records.plugins.lifecycle_plugins`: the predictor, replica sync, and the
decision log when a ``sink`` is given), plus any ``plugins`` passed in; they hear of every
decision, first token and finish (with the core's :class:`~cachepilot.core.lifecycle.Outcome`)
as the gateway's do. What each request went through is also kept as a :class:`RequestResult`
for the run's measures: measured TTFT, the engine's real cached-token count, the finish time.
"""

from __future__ import annotations

import functools
import heapq
import time as _time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cachepilot.core import (
    CostModel,
    Decision,
    InferenceRequest,
    Pool,
    PoolSpec,
    Router,
    RoutingError,
    Weights,
    WorkerMetrics,
)
from cachepilot.core.flow.queue import Ticket
from cachepilot.core.lifecycle import FIRST_TOKEN, Outcome, Plugin
from cachepilot.core.policies import Policy, make_policy
from cachepilot.core.predictor import TTFTPredictor
from cachepilot.core.sync import ReplicaSync
from cachepilot.records.plugins import DecisionSink, lifecycle_plugins
from cachepilot.sim.engine import Engine, EngineConfig, EngineRequest
from cachepilot.sim.flow_driver import FlowDriver, SimFlow, meta_of
from cachepilot.sim.peers import SIM_POLICIES
from cachepilot.sim.slot_engine import make_engine
from cachepilot.sim.workloads import BLOCK, MODEL, SimRequest, Workload

ARRIVAL, STEP_END, SCRAPE, SYNC, HEARTBEAT, FLOW = 0, 1, 2, 3, 4, 5
# Beyond the bus delay, before a replica whose turn it is routes (ReplicaSpread.reach_s).
REACH_MARGIN_S = 0.0005
# Synced replicas send the ids they have in flight this often, as the gateway's bus does
# (cachepilot.gateway.replica_bus): it is also how each hears that the others are routing.
HEARTBEAT_S = 1.0


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulated deployment. Engine and cost defaults: a 7–8B model on one datacenter
    GPU (see docs/simulator.md for the sources)."""

    workers: int = 3
    policy: str = "priced"
    weights: Weights = field(default_factory=Weights)
    cost: CostModel = field(default_factory=CostModel)
    engine: EngineConfig = field(default_factory=EngineConfig)
    scrape_interval_s: float = 0.1
    # Stop simulating this long after the last arrival (None: drain every request).
    drain_limit_s: float | None = None
    # Learn each worker's TTFT model from the engines' first tokens, as the gateway does.
    learn: bool = True
    # Gateway replicas, each a Router with its own state (directory, in-flight counts,
    # predictor), all scraping the same engines; ``sharing`` says which replica a request
    # reaches (see :data:`SHARINGS`).
    replicas: int = 1
    sharing: str = "random"
    # Replicas share placements and in-flight bookings (cachepilot.core.sync) over a bus
    # with this one-way delay; None: they do not talk.
    sync_delay_s: float | None = None
    # Scrapes carry the engines' prefill progress (WorkerMetrics.prefill_done_tokens).
    prefill_progress: bool = True
    # Flow control (cachepilot.sim.flow_driver): hold instead of reject, by band and tenant
    # (a request's extra: tenant, priority, slo_ms). None: off, the router's admission
    # limit answers 429 (the studies before issue 25 ran so; they still do).
    flow: SimFlow | None = None


# How requests reach one of several gateway replicas: ``random`` per request (Envoy's
# random load balancing over the ext_proc cluster), ``round_robin`` (Envoy's default), or
# ``service``: a Kubernetes Service balances connections, so each client (a request's
# prefix group or session) keeps one random replica for a connection's lifetime
# (SERVICE_REQUESTS_PER_CONNECTION requests), then reconnects to a random one.
SHARINGS = ("random", "round_robin", "service")
SERVICE_REQUESTS_PER_CONNECTION = 100


@dataclass(slots=True)
class _Replica:
    """One gateway replica: its own pool state and router over the shared engines."""

    pool: Pool
    router: Router
    predictor: TTFTPredictor | None
    sync: ReplicaSync | None = None


@dataclass(slots=True)
class RequestResult:
    """What one simulated request went through, for the run's measures."""

    request_id: int
    worker: str | None
    arrival: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0  # the engine's real count, not the router's prediction
    ttft_s: float | None = None
    predicted_ttft_s: float | None = None  # the router's prediction for the chosen worker
    first_token_at: float | None = None
    finished_at: float | None = None
    rejected: str | None = None  # RoutingError code when no worker took it
    tenant: str = "default"  # its tenant and band (the request's extra)
    priority: int = 0
    held_s: float = 0.0  # time flow control held it (part of ttft_s)
    turn_s: float = 0.0  # time its replica held it for its turn (part of ttft_s)


@dataclass(slots=True)
class _Worker:
    addr: str
    engine: Engine
    busy: bool = False
    assigned: int = 0
    max_waiting: int = 0  # largest queue any scrape saw


@dataclass(slots=True)
class RunResult:
    """Everything measured in one run; :func:`cachepilot.sim.measures.summarize` turns it
    into numbers."""

    config: SimConfig
    workload: dict[str, Any]
    results: list[RequestResult]
    workers: dict[str, dict[str, float]]
    makespan: float
    start: float
    wall_s: float
    events: int


class Simulator:
    """Drive a workload through the router and the engines. One instance = one run."""

    def __init__(self, config: SimConfig, *, policy: Policy | None = None,
                 plugins: Sequence[Plugin] = (), sink: DecisionSink | None = None) -> None:
        self.cfg = config
        if config.engine.block_size != BLOCK.block_size:
            raise ValueError("router and engine block sizes must be equal "
                             f"({BLOCK.block_size} vs {config.engine.block_size})")
        if config.sharing not in SHARINGS:
            raise ValueError(f"unknown sharing {config.sharing!r}; choose one of: "
                             f"{', '.join(SHARINGS)}")
        if config.replicas < 1 or (policy is not None and config.replicas > 1):
            raise ValueError("replicas must be ≥ 1, and a policy instance serves one replica")
        spec = PoolSpec(name="sim", models=(MODEL,), policy=config.policy,
                        weights=config.weights, cost=config.cost, block=BLOCK,
                        capacity_blocks=config.engine.num_blocks,
                        prompt_cache=config.engine.prompt_cache,
                        min_reuse_tokens=config.engine.sliding_window,
                        ubatch_tokens=config.engine.max_batched_tokens)
        addrs = [f"10.0.0.{i + 1}:8000" for i in range(config.workers)]
        self.replicas: list[_Replica] = []
        for i in range(config.replicas):
            pool = Pool(spec, policy=policy or make_policy(config.policy, SIM_POLICIES))
            for addr in addrs:
                pool.upsert_worker(addr)
            shared = config.sync_delay_s is not None and config.replicas > 1
            life = lifecycle_plugins(learn=config.learn, replica=f"r{i}" if shared else None,
                                     sink=sink, extra=plugins)
            router = Router([pool], id_prefix=f"sim{i or ''}", plugins=life.plugins)
            if shared and life.sync is not None and life.sync.spread is not None:
                # A placement reaches the others after the bus delay; the turns replicas
                # take on long prompts (ReplicaSpread.hold_s) wait that, with a margin.
                life.sync.spread.reach_s = config.sync_delay_s + REACH_MARGIN_S
            self.replicas.append(_Replica(pool, router, life.predictor, life.sync))
        first = self.replicas[0]
        self.pool, self.router, self.predictor = first.pool, first.router, first.predictor
        self.policy = first.pool.policy
        self.workers = {addr: _Worker(addr, make_engine(config.engine)) for addr in addrs}
        self._rng = np.random.default_rng(0)  # replica choice; seeded: runs stay paired
        self._client_replica: dict[str, tuple[int, int]] = {}  # service: (replica, left)
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self.now = 0.0
        if config.flow is not None and config.replicas > 1:
            raise ValueError("flow control is simulated with one gateway replica")
        self.flow = (None if config.flow is None else
                     FlowDriver(config.flow, self.router, lambda t: self._push(t, FLOW, None)))

    # -- events ---------------------------------------------------------------------------------
    def _push(self, t: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, payload))

    def scrape(self, now: float) -> None:
        """Copy every engine's state into each replica's pool, as its scraper would."""
        ecfg = self.cfg.engine
        for addr, w in self.workers.items():
            e = w.engine
            if len(e.waiting) > w.max_waiting:
                w.max_waiting = len(e.waiting)
            # Prefill progress: llama-server's /slots say it; for vLLM it is what the KV
            # events of a chunked prefill show (blocks stored as they are computed).
            done = e.prefill_done_tokens(w.busy) if self.cfg.prefill_progress else 0
            if ecfg.slots:  # what llama-server says: no KV gauge; slots and context (/props)
                m = WorkerMetrics(
                    waiting=len(e.waiting), running=e.running, slots=ecfg.slots,
                    slot_tokens=ecfg.num_blocks // ecfg.slots * ecfg.block_size,
                    prefix_queries=float(e.prefix_queries), prefix_hits=float(e.prefix_hits),
                    prefill_done_tokens=done, scraped_at=now)
            else:
                m = WorkerMetrics(
                    waiting=len(e.waiting), running=e.running, kv_usage=e.kv_usage(),
                    block_size=ecfg.block_size, num_blocks=ecfg.num_blocks,
                    max_batch=ecfg.max_batch, prefix_queries=float(e.prefix_queries),
                    prefix_hits=float(e.prefix_hits), prefill_done_tokens=done,
                    scraped_at=now)
            for rep in self.replicas:
                rep.pool.update_metrics(addr, m)

    def _replica_for(self, r: SimRequest, seq: int) -> Router:
        n = len(self.replicas)
        if n == 1:
            return self.router
        if self.cfg.sharing == "round_robin":
            return self.replicas[seq % n].router
        if self.cfg.sharing == "random":
            return self.replicas[int(self._rng.integers(n))].router
        i, left = self._client_replica.get(r.group, (0, 0))
        if left <= 0:
            i, left = int(self._rng.integers(n)), SERVICE_REQUESTS_PER_CONNECTION
        self._client_replica[r.group] = (i, left - 1)
        return self.replicas[i].router

    def run(self, workload: Workload | list[SimRequest]) -> RunResult:
        reqs = workload.requests if isinstance(workload, Workload) else workload
        wl_info = (workload.spec.to_dict() | {"seed": workload.seed}
                   if isinstance(workload, Workload) else {"kind": "list"})
        wall0 = _time.perf_counter()
        results: list[RequestResult] = []
        if not reqs:
            return RunResult(self.cfg, wl_info, [], self._worker_stats(0.0), 0.0, 0.0,
                             0.0, 0)
        start = reqs[0].arrival
        last_arrival = reqs[-1].arrival
        for r in reqs:
            self._push(r.arrival, ARRIVAL, r)
        interval = self.cfg.scrape_interval_s
        self.scrape(start)
        if interval > 0:
            self._push(start + interval, SCRAPE, None)
        if self.cfg.sync_delay_s is not None and len(self.replicas) > 1:
            self._heartbeat(start)
        stop_at = (None if self.cfg.drain_limit_s is None
                   else last_arrival + self.cfg.drain_limit_s)
        inflight: dict[int, tuple[Router, Decision, RequestResult]] = {}
        events = 0
        arrivals = 0
        heap = self._events
        pop = heapq.heappop
        remaining = len(reqs)
        while heap and remaining:
            t, _, kind, payload = pop(heap)
            if stop_at is not None and t > stop_at:
                break
            self.now = t
            events += 1
            if kind == ARRIVAL:
                turn = isinstance(payload, tuple)  # (request, replica, wait): its turn came
                if turn:
                    r, router, turn_s = payload
                else:
                    r, turn_s = payload, 0.0
                    router = self._replica_for(r, arrivals)
                    arrivals += 1
                if interval <= 0:
                    self.scrape(t)
                # What the client asked for (a cap: flow control's estimate of the output),
                # which the engine's real length (max_tokens) may not reach.
                cap = r.extra.get("client_max_tokens", r.max_tokens)
                ireq = InferenceRequest(model=MODEL, max_tokens=cap, fingerprint=r.fp,
                                        user_start=r.user_start, prefix_key=r.prefix_key,
                                        turn_ms=turn_s * 1000.0)
                wait = 0.0 if turn else router.replica_hold_s(ireq, t)
                if wait > 0:  # replicas take turns on a long prompt (core.spread)
                    self._push(t + wait, ARRIVAL, (r, router, wait))
                    continue
                out = RequestResult(r.id, None, r.arrival, r.prompt_tokens, r.max_tokens,
                                    turn_s=turn_s)
                meta = meta_of(r.extra)
                out.tenant, out.priority = meta.tenant, meta.priority
                try:
                    if self.flow is None:
                        d = router.route(ireq, t, f"r{r.id}")
                    else:
                        held = self.flow.admit(ireq, meta, t, functools.partial(
                            self._released, r, out, inflight, results))
                        if not isinstance(held, Decision):
                            continue  # held: _released submits it, or records its refusal
                        d = held
                except RoutingError as exc:  # the router's plugins have heard of it
                    out.rejected = exc.code
                    results.append(out)
                    remaining -= 1
                    continue
                self._submit(router, d, r, out, t, inflight)
            elif kind == STEP_END:
                w, res = payload
                w.busy = False
                for er in res.first_tokens:
                    router, d, out = inflight[er.id]
                    out.first_token_at = er.first_token_at
                    out.ttft_s = er.first_token_at - out.arrival
                    out.cached_tokens = er.cached_tokens
                    router.first_token(d, (er.first_token_at - d.time) * 1000.0)
                    if self.flow is not None:
                        self.flow.charge(d, 1, t)
                if self.flow is not None and self.flow.spec.charge_as_generated:
                    for er in res.decoded:
                        self.flow.charge(inflight[er.id][1], 1, t)
                for er in res.finished:
                    router, d, out = inflight.pop(er.id)
                    out.finished_at = er.finished_at
                    router.release(d, Outcome(  # TTFT from dispatch: what the router predicted
                        status=200, ttft_ms=None if out.first_token_at is None
                        else (out.first_token_at - d.time) * 1000.0,
                        ttft_kind=FIRST_TOKEN, cached_tokens=out.cached_tokens,
                        completion_tokens=out.output_tokens, completed_at=er.finished_at))
                    results.append(out)
                    remaining -= 1
                if w.engine.has_work():
                    self._start_step(w, t)
            elif kind == SCRAPE:
                self.scrape(t)
                if remaining:
                    self._push(t + interval, SCRAPE, None)
            elif kind == HEARTBEAT:
                self._heartbeat(t)
            elif kind == FLOW:
                pass  # a flow-control deadline or tick: after_event below pumps
            else:  # SYNC: one replica's events reach the others
                source, batch = payload
                for rep in self.replicas:
                    if rep.sync is not None and rep is not source:
                        for e in batch:
                            rep.sync.apply(e, rep.router, t)
            if self.cfg.sync_delay_s is not None:
                self._send_sync(t)
            if self.flow is not None:
                self.flow.after_event(t, timer=kind == FLOW)
                remaining = len(reqs) - len(results)
        for _, _, out in inflight.values():  # cut off by drain_limit_s: never finished
            results.append(out)
        end = max((o.finished_at for o in results if o.finished_at is not None),
                  default=start)
        results.sort(key=lambda o: o.request_id)
        return RunResult(self.cfg, wl_info, results, self._worker_stats(end - start),
                         end - start, start, _time.perf_counter() - wall0, events)

    def _heartbeat(self, now: float) -> None:
        """Every synced replica puts its in-flight ids on the bus; the next in a second."""
        for rep in self.replicas:
            if rep.sync is not None:
                rep.sync.heartbeat()
        self._push(now + HEARTBEAT_S, HEARTBEAT, None)

    def _submit(self, router: Router, d: Decision, r: SimRequest, out: RequestResult,
                t: float, inflight: dict[int, tuple[Router, Decision, RequestResult]]) -> None:
        """A routed request reaches its engine."""
        out.predicted_ttft_s = d.winner.predicted_ttft_ms / 1000.0
        out.worker = d.chosen
        if d.flow is not None:
            out.held_s = d.flow.held_ms / 1000.0
        w = self.workers[d.chosen]
        w.assigned += 1
        er = EngineRequest(r.id, r.prompt_tokens, r.fp.hashes, r.max_tokens, t)
        inflight[r.id] = (router, d, out)
        w.engine.submit(er)
        if not w.busy:
            self._start_step(w, t)

    def _released(self, r: SimRequest, out: RequestResult,
                  inflight: dict[int, tuple[Router, Decision, RequestResult]],
                  results: list[RequestResult], ticket: Ticket) -> None:
        """A held request left flow control's queue: to its engine, or refused."""
        if ticket.decision is not None:
            self._submit(self.router, ticket.decision, r, out, self.now, inflight)
        elif ticket.error is not None:
            out.rejected = ticket.error.code
            results.append(out)

    def _send_sync(self, now: float) -> None:
        """Put every replica's new events on the bus, delivered after the delay."""
        assert self.cfg.sync_delay_s is not None
        for rep in self.replicas:
            if rep.sync is not None and rep.sync.outbox:
                self._push(now + self.cfg.sync_delay_s, SYNC, (rep, rep.sync.drain()))

    def _start_step(self, w: _Worker, now: float) -> None:
        res = w.engine.step(now)
        if res.duration <= 0.0:  # nothing admissible: waits for a finish elsewhere (never here)
            return
        w.busy = True
        self._push(res.end, STEP_END, (w, res))

    def _worker_stats(self, makespan: float) -> dict[str, dict[str, float]]:
        out = {}
        for addr, w in self.workers.items():
            s = w.engine.stats()
            out[addr] = {
                "assigned": w.assigned, "busy_time": s.busy_time,
                "utilization": s.busy_time / makespan if makespan > 0 else 0.0,
                "evictions": s.evictions, "prefix_queries": s.prefix_queries,
                "prefix_hits": s.prefix_hits, "completed": s.completed,
                "directory_evictions": sum(rep.pool.directory.stats()[addr]["evictions"]
                                           for rep in self.replicas),
                "max_waiting_scraped": w.max_waiting,
            }
        return out


def simulate(workload: Workload, config: SimConfig | None = None, **kw: Any) -> RunResult:
    """One run: ``simulate(generate(spec, seed), SimConfig(policy="priced"))``."""
    return Simulator(config or SimConfig(), **kw).run(workload)


def ideal_ttfts(workload: Workload | list[SimRequest],
                engine: EngineConfig | None = None) -> np.ndarray:
    """TTFT each request would see with no queueing and every prefix that any earlier
    request computed already cached on its worker: its own step(s) of uncached prefill only.
    (At least one token is always computed, as in the engine.)"""
    cfg = engine or EngineConfig()
    reqs = workload.requests if isinstance(workload, Workload) else workload
    seen: set[int] = set()
    out = np.empty(len(reqs))
    bs = cfg.block_size
    for i, r in enumerate(reqs):
        hit = 0
        for h in r.fp.hashes:
            if h not in seen:
                break
            hit += 1
        uncached = max(1, r.prompt_tokens - hit * bs)
        steps = -(-uncached // cfg.max_batched_tokens)
        out[i] = (steps * cfg.step_ms + uncached * cfg.prefill_ms_per_token) / 1000.0
        seen.update(r.fp.hashes)
    return out
