"""The router: one synchronous call per request, no I/O, the caller's clock."""

from __future__ import annotations

import os
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import replace
from itertools import islice

from xxhash import xxh3_64_intdigest

from cachepilot.core.cost import (
    CostModel,
    Weights,
    ahead_of,
    congestion_ms_of,
    effective_load,
    kv_pressure_ms,
    queue_ms,
)
from cachepilot.core.decision import Candidate, Decision, RoutingError
from cachepilot.core.fingerprint import BlockConfig, Fingerprint, Tokenizer
from cachepilot.core.lifecycle import Outcome, Plugin, Response
from cachepilot.core.policies import Context, pick
from cachepilot.core.pool import Pool, PoolSpec
from cachepilot.core.prefix_cache import Fingerprinter
from cachepilot.core.request import InferenceRequest, RequestError
from cachepilot.core.spread import ReplicaSpread
from cachepilot.core.vllm_prompt import VllmPrompts, engine_fingerprint
from cachepilot.core.workers import TTFTParams, WorkerSnapshot, WorkerState


class Router:
    """Routes requests to workers of the pool that serves their model, and drives each
    request's lifecycle (:mod:`cachepilot.core.lifecycle`): ``route`` → ``first_token`` →
    ``release``, calling the pool's policy and then ``plugins`` at each step."""

    def __init__(self, pools: Iterable[Pool] = (), *, id_prefix: str | None = None,
                 tokenizer: Tokenizer | None = None, plugins: Sequence[Plugin] = (),
                 prompts: VllmPrompts | None = None) -> None:
        self.pools: dict[str, Pool] = {p.name: p for p in pools}
        self.tokenizer = tokenizer
        self.fingerprinter = Fingerprinter(tokenizer)
        # The engines' prompt path (tokenizer, chat template, LoRA adapters) for pools that
        # hash as vLLM does and have none of their own (Pool.prompts).
        self.prompts = prompts
        self.plugins: tuple[Plugin, ...] = ()
        # Set when this router is one of several replicas (its ReplicaSync's): how near-ties
        # are split between replicas routing at the same moment (cachepilot.core.spread).
        self.spread: ReplicaSpread | None = None
        for plugin in plugins:
            self.add_plugin(plugin)
        self._id_prefix = id_prefix if id_prefix is not None else os.urandom(4).hex()
        self._counter = 0
        # (pool, worker) → decisions sent there whose first token has not come: the
        # prefill in progress, which an engine's KV events show block by block.
        self._prefilling: dict[tuple[str, str], dict[int, Decision]] = {}  # by id()

    def add_plugin(self, plugin: Plugin) -> None:
        """Register a lifecycle plugin; it sees every request routed from now on. A replica
        sync plugin also brings the replicas' tie spreading."""
        self.plugins = (*self.plugins, plugin)
        spread = getattr(plugin, "spread", None)
        if isinstance(spread, ReplicaSpread):
            self.spread = spread

    def add_pool(self, pool: Pool) -> None:
        self.pools[pool.name] = pool

    def remove_pool(self, name: str) -> None:
        self.pools.pop(name, None)

    def pool_for(self, model: str) -> Pool:
        fallback = None
        for pool in self.pools.values():
            if model in pool.spec.models:
                return pool
            if not pool.spec.models and fallback is None:
                fallback = pool
        if fallback is None:
            served = sorted({m for p in self.pools.values() for m in p.spec.models})
            raise RequestError(404, f"model {model!r} is not served here; models: {served}",
                               code="model_not_found")
        return fallback

    def fingerprint(self, req: InferenceRequest, pool: Pool) -> Fingerprint:
        """The request's block hashes: given (the simulator), or computed, reusing what a
        long prompt shares with a recent one (:class:`Fingerprinter`)."""
        if isinstance(req.fingerprint, Fingerprint):
            return req.fingerprint
        try:
            return self._fingerprint(req, pool)
        except (ValueError, OverflowError, TypeError):  # e.g. token ids out of range
            # Not hashable as its engine would (the engine will say why): routed by load.
            return Fingerprint((), 0, pool.spec.block.block_size, fallback="unhashable")

    def _fingerprint(self, req: InferenceRequest, pool: Pool) -> Fingerprint:
        block = pool.spec.block
        if block.vllm_seed is not None:  # exact where the engine's prompt is reproduced
            prompts = pool.prompts if pool.own_prompts else pool.prompts or self.prompts
            return engine_fingerprint(req, req.model, block, prompts, self.tokenizer,
                                      chains=self.fingerprinter.chains)
        return self.fingerprinter(req.model, block, text=req.prompt, token_ids=req.token_ids)

    def _turn_blocks(self, req: InferenceRequest, pool: Pool, worker: str) -> int:
        """A chat request to a slot engine: the full blocks before its last message, where
        llama-server checkpoints (:meth:`~cachepilot.core.slot_memory.SlotMemory.place`).
        Byte blocks only (0 where blocks are tokens: the offset would need the tokenizer)."""
        if (not req.last_message_at or req.token_ids is not None
                or self.fingerprinter.tokenizer is not None
                or pool.spec.block.vllm_seed is not None
                or not pool.directory.is_slot(worker)):
            return 0
        return req.blocks_before_last_message(pool.spec.block.block_bytes)

    def next_id(self) -> str:
        self._counter += 1
        return f"{self._id_prefix}-{self._counter:x}"

    def route(self, req: InferenceRequest, now: float, decision_id: str | None = None, *,
              only: Collection[str] | None = None, started: float | None = None) -> Decision:
        """Pick a worker, record the placement in the directory, count it in flight.
        ``only``: the workers that may be picked (a proxy's subset hint; the others are
        priced but filtered as "subset"). ``started``: ``time.perf_counter()`` when the
        driver began on the request (parsing included), for the decision's latency. A
        request no pool serves, or no worker can take, raises :class:`RequestError`
        (:class:`RoutingError`), after the plugins heard of it (``on_rejected``)."""
        try:
            pool, fp = self.prepare(req)
            decision = self.decide(pool, req.model, fp, now, decision_id or self.next_id(),
                                   req, only=only)
        except RequestError as err:  # no pool for the model, or no worker can take it
            self.reject(err, req, now)
            raise
        return self.book(decision, pool, fp, req, now, started)

    def prepare(self, req: InferenceRequest) -> tuple[Pool, Fingerprint]:
        """The pool serving the request's model (RequestError 404 if none) and its
        fingerprint."""
        pool = self.pool_for(req.model)
        return pool, self.fingerprint(req, pool)

    def replica_hold_s(self, req: InferenceRequest, now: float) -> float:
        """How long this replica should hold ``req`` before routing it, in seconds (0: route
        now): with other replicas routing, long uncached prompts take turns by replica
        (:meth:`~cachepilot.core.spread.ReplicaSpread.hold_s`). Prices the request without
        booking it; a request that cannot be routed is not held (routing says why)."""
        spread = self.spread
        if spread is None or spread.turn(now) == 0:  # alone, or first: never held
            return 0.0
        try:
            pool, fp = self.prepare(req)
            probe = self.decide(pool, req.model, fp, now, "hold", req)
        except RequestError:
            return 0.0
        return spread.hold_s(probe.winner.prefill_ms, now)

    def book(self, decision: Decision, pool: Pool, fp: Fingerprint, req: InferenceRequest,
             now: float, started: float | None = None) -> Decision:
        """Commit a decision of :meth:`decide`: its worker counts it in flight and holds its
        prefix, the pool counts it, then the policy and the plugins hear of it."""
        decision.request = req
        decision.turn_ms = req.turn_ms
        worker = pool.workers[decision.chosen]
        worker.inflight += 1
        worker.assigned += 1
        decision.uncached_tokens = fp.tokens - decision.winner.matched_tokens
        decision.prefill_pending = True
        worker.pending_requests += 1
        worker.pending_prefill_tokens += decision.uncached_tokens
        self._prefilling.setdefault((pool.name, decision.chosen), {})[id(decision)] = decision
        pool.directory.insert(decision.chosen, fp.hashes, learned_only=fp.fallback is not None,
                              turn=self._turn_blocks(req, pool, decision.chosen))
        pool.note_arrival(now, decision.uncached_tokens)
        pool.seq += 1
        if self.spread is not None:
            self.spread.picked(decision.chosen, now)
        if started is not None:
            decision.latency_s = time.perf_counter() - started
        pool.policy.on_routed(decision, pool)
        for plugin in self.plugins:
            plugin.on_routed(decision, pool)
        return decision

    def reject(self, error: RequestError, request: InferenceRequest | None = None,
               now: float = 0.0) -> None:
        """The request is answered with ``error`` and no worker: tell the plugins (metrics
        count it). Routing errors call this themselves, before they are raised."""
        for plugin in self.plugins:
            plugin.on_rejected(error, request, now)

    def decide(self, pool: Pool, model: str, fp: Fingerprint, now: float,
               decision_id: str, req: InferenceRequest | None = None, *,
               only: Collection[str] | None = None,
               excluded: Mapping[str, str] | None = None) -> Decision:
        """Score every worker and pick one, changing nothing (:meth:`book` commits it).
        ``excluded``: workers the caller takes out of this pick, by the filter reason the
        decision records for each (flow control's closed workers); they are still valued,
        so the caller can see what waiting for one would be worth. The gateway and the
        simulator reach it through :meth:`route` (or flow control); replay calls it on a
        pool rebuilt from the record (:mod:`cachepilot.records.replay`)."""
        spec = pool.spec
        cost = spec.cost
        matches = pool.directory.match(fp.hashes, pool.workers, chained=True,
                                       learned_only=fp.fallback is not None)
        rate = pool.arrival_rate(now)
        # Arrivals per ms at one worker, if the pool's recent rate spread evenly.
        lam = rate / 1000.0 / max(1, len(pool.workers))
        prior = cost.ttft  # a worker's model until the predictor has learned its own
        typical = pool.typical_uncached
        cands: list[Candidate] = []
        for addr, worker in pool.workers.items():
            w = self._with_progress(pool, addr, worker, now)
            load = effective_load(w, now, cost)
            blocks = matches.get(addr, 0)
            matched_tokens = min(blocks * fp.block_size, fp.tokens)
            uncached = fp.tokens - matched_tokens
            p = w.ttft or prior
            evict = pool.directory.eviction_blocks(addr, fp.hashes)
            ahead, queued, batch_waits = ahead_of(load, w, typical, cost)
            backlog_ms = queue_ms(ahead, load.running, queued, batch_waits, p)
            prefill_ms = uncached * p.prefill_ms_per_token
            c = Candidate(
                worker=addr, state=w, matched_blocks=blocks, matched_tokens=matched_tokens,
                waiting=load.waiting, running=load.running, queued=queued,
                batch_waits=batch_waits, ahead_tokens=ahead, kv_usage=load.kv_usage,
                metrics_age_ms=None if load.age_s is None else load.age_s * 1000.0,
                saved_ms=matched_tokens * p.prefill_ms_per_token,
                prefill_ms=prefill_ms, queue_ms=backlog_ms,
                kv_ms=kv_pressure_ms(load, fp.blocks - blocks, w, cost),
                congestion_ms=congestion_ms_of(prefill_ms, lam, backlog_ms, cost),
                evict_blocks=evict,
                eviction_ms=evict * fp.block_size * p.prefill_ms_per_token,
            )
            c.predicted_ttft_ms = p.base_ms + c.prefill_ms + c.queue_ms + c.kv_ms
            if only is not None and addr not in only:
                c.eligible, c.filtered = False, "subset"
            elif not w.ready:
                c.eligible, c.filtered = False, "not_ready"
            elif load.stale:
                c.eligible, c.filtered = False, "stale"
            elif load.waiting >= cost.admission_limit:
                c.eligible, c.filtered = False, "full"
            elif excluded is not None and addr in excluded:
                c.eligible, c.filtered = False, excluded[addr]
            cands.append(c)
        d = self._pick(pool, model, fp, now, decision_id, cands, req, only, excluded)
        d.arrival_rate, d.typical_uncached = rate, pool.typical_uncached
        return d

    def _pick(self, pool: Pool, model: str, fp: Fingerprint, now: float, decision_id: str,
              cands: list[Candidate], req: InferenceRequest | None,
              only: Collection[str] | None,
              excluded: Mapping[str, str] | None = None) -> Decision:
        eligible = [c for c in cands if c.eligible]
        if not eligible:
            raise _no_worker(pool, cands, only)
        ctx = Context(seq=pool.seq, tokens=fp.tokens, weights=pool.spec.weights,
                      fingerprint=fp, request=req)
        values = pool.policy.values(eligible, ctx)
        for c, v in zip(eligible, values, strict=True):
            c.value = v
        if excluded:  # valued too: what waiting for one of them would be worth
            parked = [c for c in cands if c.filtered is not None
                      and excluded.get(c.worker) == c.filtered]
            for c, v in zip(parked, pool.policy.values(parked, ctx) if parked else (),
                            strict=True):
                c.value = v
        tie_key = xxh3_64_intdigest(decision_id.encode())
        spread = self.spread
        note = None
        if spread is not None and spread.active(now):
            i, margin, note = _spread_pick(spread, eligible, values, pool.policy.tie_tolerance,
                                           tie_key, now)
        else:
            i, margin = pick(values, pool.policy.tie_tolerance, tie_key)
        chosen = eligible[i]
        reason = _reason(chosen, eligible, margin) if note is None else f"{note}; {_hit(chosen)}"
        return Decision(
            id=decision_id, time=now, pool=pool.name, model=model, policy=pool.policy.name,
            weights=pool.spec.weights.to_dict(), seq=ctx.seq, tokens=fp.tokens,
            block_size=fp.block_size, hashes=fp.hashes, candidates=cands,
            chosen=chosen.worker, margin_ms=margin, reason=reason, fallback=fp.fallback,
        )

    def responded(self, decision: Decision, response: Response) -> None:
        """The response's headers: a failover or an unreachable worker marks the chosen
        worker down (no more requests until a scrape finds it back); then the plugins."""
        if response.failed_over or response.unreachable:
            pool = self.pools.get(decision.pool)
            if pool is not None:
                also = f"; {response.answered_by} answered" if response.failed_over else ""
                pool.set_down(decision.chosen, "connect", f"Envoy could not connect{also}")
        for plugin in self.plugins:
            plugin.on_response(decision, response)

    def first_token(self, decision: Decision, ttft_ms: float | None = None) -> None:
        """The worker answered: this request's prefill no longer queues ahead of others.
        ``ttft_ms`` is a measured time to first token (None: not known). Once per decision."""
        if not self._prefill_done(decision):
            return
        pool = self.pools.get(decision.pool)
        if pool is not None:
            pool.policy.on_first_token(decision, ttft_ms)
        for plugin in self.plugins:
            plugin.on_first_token(decision, ttft_ms)

    def vacate(self, decision: Decision, at: float) -> None:
        """The request is over (its proxy ended it at ``at``) and its outcome comes later
        (Envoy's access log sends entries in batches): it no longer occupies its worker, so
        the next request is priced without it; :meth:`release` then reports the outcome."""
        if decision.finished or decision.vacated:
            return
        self.first_token(decision)  # an ended response's prefill is over (no-op if known)
        self._free_worker(decision, at)

    def release(self, decision: Decision, outcome: Outcome | None = None) -> None:
        """The request finished, failed or was abandoned: it no longer occupies its worker
        (unless vacated already). Idempotent: the lifecycle's end is reported to the plugins
        once."""
        if decision.finished:
            return
        decision.finished = True
        self._prefill_done(decision)
        outcome = outcome or Outcome()
        self._free_worker(decision, outcome.completed_at)
        pool = self.pools.get(decision.pool)
        if pool is not None:
            pool.policy.on_finish(decision, outcome)
        for plugin in self.plugins:
            plugin.on_finish(decision, outcome)

    def _with_progress(self, pool: Pool, addr: str, worker: WorkerState, now: float
                       ) -> WorkerSnapshot:
        """The worker as priced, with how far the prefills this router sent there have got
        put in its metrics (:attr:`WorkerMetrics.prefill_done_tokens`) when the engine's
        events or its slots say more than the last scrape, so the record and a replay
        price the same queue."""
        w = worker.snapshot()
        pending = self._prefilling.get((pool.name, addr))
        m = w.metrics
        if not pending or m is None:
            return w  # (nothing in flight, or no scrape yet: skip, O(1))
        if pool.directory.has_events(addr):
            done = self._event_progress(pool, addr, pending)
        elif m.slots and w.ttft is not None:  # its own rate, learned (never the prior's)
            done = _slot_progress(w, pending, worker.freed_at, w.ttft, now)
        else:
            return w
        if done <= m.prefill_done_tokens:
            return w
        return replace(w, metrics=replace(m, prefill_done_tokens=done))

    @staticmethod
    def _event_progress(pool: Pool, addr: str, pending: Mapping[int, Decision]) -> int:
        """A worker whose engine publishes KV events (vLLM: a chunked prefill stores its
        blocks as it computes them) says how far the prefills sent there have got: the
        blocks of their uncached part it has announced."""
        d = pool.directory
        return sum(min(p.uncached_tokens, p.block_size * d.stored_blocks(
            addr, p.hashes[p.winner.matched_blocks:])) for p in pending.values())

    def _free_worker(self, decision: Decision, at: float | None) -> None:
        """The worker counts the request no more (once: :meth:`vacate` or :meth:`release`);
        ``at``: when it was free, if known."""
        if decision.vacated:
            return
        decision.vacated = True
        pool = self.pools.get(decision.pool)
        w = None if pool is None else pool.workers.get(decision.chosen)
        if w is not None and w.inflight > 0:
            w.inflight -= 1
            if at is not None:
                w.freed_at = max(w.freed_at, at)

    def _prefill_done(self, decision: Decision) -> bool:
        """Stop counting the decision's prefill as pending; False if it already was."""
        if not decision.prefill_pending:
            return False
        decision.prefill_pending = False
        pool = self.pools.get(decision.pool)
        w = None if pool is None else pool.workers.get(decision.chosen)
        pending = self._prefilling.get((decision.pool, decision.chosen))
        if pending:
            pending.pop(id(decision), None)
        if w is not None:
            w.pending_requests = max(0, w.pending_requests - 1)
            w.pending_prefill_tokens = max(0, w.pending_prefill_tokens - decision.uncached_tokens)
            # What it stored is announced by now: a later removal is a real eviction.
            pool.directory.prefilled(decision.chosen, decision.hashes)
            if w.metrics is not None and w.metrics.prefill_done_tokens:
                # The progress the last scrape reported was most likely this request's.
                w.metrics = replace(w.metrics, prefill_done_tokens=0)
        return True


def _slot_progress(w: WorkerSnapshot, pending: Mapping[int, Decision], freed_at: float,
                   p: TTFTParams, now: float) -> int:
    """How far a slot engine (llama.cpp) has got with the prefills this router sent it,
    between its ``/slots`` readings (each scrape): the engine prefills its requests in
    arrival order, one per free slot, so the oldest this router sent has been prefilling
    since it was sent or since the last one of this router's left the worker, whichever is
    later. Counted at the worker's own learned rate (the caller passes it; never the pool's
    prior, which prices a CPU worker's prefill ~30 times too fast), less its fixed cost per
    request: the price already charged for that time, so a queue priced at dispatch drains
    with the clock instead of standing still for up to a scrape interval; never past the
    prefills that can hold a slot. None when every slot is decoding or the engine has work
    this router did not send (then its order is not ours to know). On real one-slot
    workers (fresh seeds 231-235) a request held for its holder left for a cold prefill
    30 ms before the holder's first token, its 270 tokens priced whole from a reading 0.85 s
    older."""
    m = w.metrics
    assert m is not None and m.slots
    free = m.slots - (w.inflight - w.pending_requests)  # slots not decoding ours
    foreign = m.waiting + m.running - m.router_inflight
    if free <= 0 or foreign > 0 or p.prefill_ms_per_token <= 0:
        return 0
    heads = list(islice(pending.values(), free))  # booking order: the engine's order
    since = max(heads[0].time, freed_at)
    ran_ms = (now - since) * 1000.0 - p.base_ms
    if ran_ms <= 0:
        return 0
    return min(sum(h.uncached_tokens for h in heads), int(ran_ms / p.prefill_ms_per_token))


def static_router(workers: list[str], *, policy: str, weights: Weights, models: tuple[str, ...],
                  block: BlockConfig, capacity_blocks: int, engine: str,
                  cost: CostModel | None = None, pool_name: str = "default",
                  tokenizer: Tokenizer | None = None,
                  prompts: VllmPrompts | None = None, id_prefix: str | None = None,
                  prompt_cache: int = 0, min_reuse_tokens: int = 0,
                  ubatch_tokens: int = 512) -> Router:
    """A one-pool router over a fixed worker list (the local stack, or any non-Kubernetes use)."""
    spec = PoolSpec(name=pool_name, models=models, policy=policy, weights=weights,
                    block=block, capacity_blocks=capacity_blocks, cost=cost or CostModel(),
                    prompt_cache=prompt_cache, min_reuse_tokens=min_reuse_tokens,
                    ubatch_tokens=ubatch_tokens)
    pool = Pool(spec)
    for addr in workers:
        pool.upsert_worker(addr, labels={"engine": engine})
    return Router([pool], tokenizer=tokenizer, prompts=prompts, id_prefix=id_prefix)


def _no_worker(pool: Pool, cands: list[Candidate], only: Collection[str] | None
               ) -> RoutingError:
    """Why nothing could be picked: 503 when no worker (of the proxy's subset) is ready,
    naming those that are down and why; 429 when they are all full or unobserved (503
    within a subset: the proxy asked for those workers and cannot be sent elsewhere)."""
    considered = [c for c in cands if c.filtered != "subset"]
    subset = "" if only is None else " in the proxy's subset hint"
    if all(c.filtered in ("not_ready", None) for c in considered):
        down = [f"{c.worker}: {'; '.join(w.down.values())}" for c in considered
                if (w := pool.workers.get(c.worker)) is not None and w.down]
        return RoutingError(503, f"pool {pool.name!r} has no ready worker{subset}"
                            + (f" (down: {', '.join(down)})" if down else ""),
                            code="no_healthy_worker", retry_after_s=1.0)
    if only is not None:
        return RoutingError(503, f"no endpoint of the proxy's subset hint is eligible in "
                                 f"pool {pool.name!r}: at their admission limit or unobserved",
                            code="no_healthy_worker", retry_after_s=1.0)
    full = [c for c in considered if c.filtered == "full"]
    wait_ms = min((c.queue_ms for c in full), default=1000.0)
    return RoutingError(429, f"every worker of pool {pool.name!r} is at its admission "
                        "limit or unobserved; retry later", code="overloaded",
                        retry_after_s=max(1.0, round(wait_ms / 1000.0)))


def _spread_pick(spread: ReplicaSpread, eligible: list[Candidate], values: list[float],
                 tolerance: float, tie_key: int, now: float) -> tuple[int, float, str | None]:
    """(index, margin over the best other, why, when the replicas' split chose): among the
    candidates within the replicas' tolerance of the best that hold as much of the prompt,
    the one this replica's share says (cachepilot.core.spread)."""
    best = max(values)
    tol = spread.tolerance(best, tolerance)
    # Only workers that hold as much of the prompt as the best one: a cached prefix is not
    # given away to spread load (the replicas' views of hits agree: they share placements).
    held = eligible[values.index(best)].matched_blocks
    tied = [i for i, v in enumerate(values)
            if v >= best - tol and eligible[i].matched_blocks == held]
    i = spread.choose([c.worker for c in eligible], tied, now) if len(tied) > 1 else None
    if i is None:
        j, margin = pick(values, tolerance, tie_key)
        return j, margin, None
    others = [v for k, v in enumerate(values) if k != i]
    return (i, values[i] - max(others) if others else 0.0,
            f"{len(tied)} workers within {tol:.0f} ms of the best, split between replicas")


def _hit(chosen: Candidate) -> str:
    return (f"{chosen.matched_tokens} cached prompt tokens save {chosen.saved_ms:.0f} ms"
            if chosen.matched_tokens else "no cached prefix anywhere useful")


def _reason(chosen: Candidate, eligible: list[Candidate], margin: float) -> str:
    """One plain sentence for `cachepilot explain`."""
    if len(eligible) == 1:
        return "only eligible worker"
    hit = _hit(chosen)
    if margin <= 0:
        return f"tie broken by request hash; {hit}"
    return (f"{hit}; queue {chosen.queue_ms:.0f} ms, KV pressure {chosen.kv_ms:.0f} ms; "
            f"best by {margin:.1f}")
