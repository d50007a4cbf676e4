"""A pool: the workers serving a set of models, with their directory and routing settings."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from cachepilot.core.cost import CostModel, Weights
from cachepilot.core.directory import PrefixDirectory
from cachepilot.core.fingerprint import BlockConfig
from cachepilot.core.flow.config import FlowConfig
from cachepilot.core.policies import Policy, make_policy
from cachepilot.core.vllm_prompt import VllmPrompts
from cachepilot.core.workers import WorkerMetrics, WorkerSnapshot, WorkerState


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """Routing settings of a pool: what a CachePilotPool's spec.routing holds."""

    name: str = "default"
    models: tuple[str, ...] = ()  # empty: serves every model not claimed by another pool
    policy: str = "priced"
    weights: Weights = field(default_factory=Weights)
    cost: CostModel = field(default_factory=CostModel)
    block: BlockConfig = field(default_factory=BlockConfig)
    # Blocks per worker in the directory until the engine reports its own (cache_config_info).
    capacity_blocks: int = 4096
    # Slot engines (llama.cpp, whose /props say how many slots): the prompts each worker's
    # host-memory prompt cache keeps (its --cache-ram over one prompt's saved state; -1: no
    # byte limit, so n_ctx tokens; 0: --cache-ram 0, the slots only). Not in /props or
    # /metrics: the deployment says (cachepilot gateway --llama-cache-ram).
    prompt_cache: int = 0
    # ...and the longest match, in tokens, such a worker reuses only up to a context
    # checkpoint (a sliding-window model's window; 0: any match is reused), and its batch
    # (-ub), near whose ends of a prompt the checkpoints fall.
    min_reuse_tokens: int = 0
    ubatch_tokens: int = 512
    # Flow control's settings for this pool (a CachePilotPool's spec.flowControl); None: the
    # gateway's (cachepilot.core.flow.config.FlowConfig).
    flow: FlowConfig | None = None


class Pool:
    """Mutable routing state for one pool. Adapters mutate it (workers, metrics); the router
    reads it and records placements. Not thread-safe: drive it from one event loop."""

    def __init__(self, spec: PoolSpec, policy: Policy | None = None) -> None:
        self.spec = spec
        self.policy = policy or make_policy(spec.policy)
        self.policy.bind(self)
        self.workers: dict[str, WorkerState] = {}
        self.directory = PrefixDirectory(spec.capacity_blocks)
        # How the pool's engines turn a request into prompt tokens (vLLM pools hashing
        # exactly: tokenizer, chat template, LoRA adapters), loaded by whoever built the
        # pool; None: the router's.
        self.prompts: VllmPrompts | None = None
        self.own_prompts = False  # the pool names its own (never the router's, even if None)
        self.seq = 0
        self._rate = 0.0  # requests/s, exponentially weighted over RATE_WINDOW_S
        self._rate_at = 0.0
        self.typical_uncached = 0.0

    @classmethod
    def restored(cls, spec: PoolSpec, policy: Policy, workers: Iterable[WorkerSnapshot], *,
                 seq: int, now: float, arrival_rate: float, typical_uncached: float,
                 held: Mapping[str, Sequence[int]], evictions: Mapping[str, float]) -> Pool:
        """The pool as one recorded decision saw it (replay): its workers as priced, in the
        recorded order, each holding the prefix blocks it was matched on, the eviction
        prices as recorded, the decision counter and the recent traffic."""
        pool = cls(spec, policy)
        pool.seq = seq
        pool._rate, pool._rate_at = arrival_rate, now
        pool.typical_uncached = typical_uncached
        for snap in workers:
            pool.workers[snap.address] = WorkerState.from_snapshot(snap)
            pool.directory.add_worker(snap.address)
            pool.directory.insert(snap.address, held.get(snap.address, ()))
            pool.directory.restore_eviction(snap.address, evictions.get(snap.address, 0.0))
        return pool

    # Bursts come and go within seconds: a longer window would still be pricing the lull
    # when a burst's first requests need the congestion term.
    RATE_WINDOW_S = 2.0

    def arrival_rate(self, now: float) -> float:
        """Recent requests per second routed in this pool."""
        return self._rate * math.exp(-max(0.0, now - self._rate_at) / self.RATE_WINDOW_S)

    def note_arrival(self, now: float, uncached_tokens: int) -> None:
        self._rate = self.arrival_rate(now) + 1.0 / self.RATE_WINDOW_S
        self._rate_at = max(now, self._rate_at)
        # The typical request's uncached tokens (an EWMA over ~20 requests): what a waiting
        # request this router did not send is assumed to cost.
        a = 0.05 if self.typical_uncached else 1.0
        self.typical_uncached += a * (uncached_tokens - self.typical_uncached)

    @property
    def name(self) -> str:
        return self.spec.name

    def reconfigure(self, spec: PoolSpec) -> None:
        """Apply a changed spec; keep workers and directory (a block-size change empties it,
        since old hashes would never match again)."""
        if spec.policy != self.spec.policy:
            self.policy = make_policy(spec.policy)
            self.policy.bind(self)
        if spec.block != self.spec.block:
            self.directory = PrefixDirectory(spec.capacity_blocks)
            for w in self.workers:
                self.directory.add_worker(w)
        self.spec = spec

    def upsert_worker(self, address: str, *, ready: bool = True,
                      labels: dict[str, str] | None = None) -> WorkerState:
        w = self.workers.get(address)
        if w is None:
            w = self.workers[address] = WorkerState(address=address, ready=ready)
            self.directory.add_worker(address)
        w.declared_ready = ready
        w.ready = ready and not w.down
        if labels is not None:
            w.labels = labels
        return w

    def remove_worker(self, address: str) -> None:
        self.workers.pop(address, None)
        self.directory.remove_worker(address)

    def set_ready(self, address: str, ready: bool) -> None:
        """Declared readiness (the pod's, or an operator's say): routable once not down."""
        w = self.workers.get(address)
        if w is not None:
            w.declared_ready = ready
            w.ready = ready and not w.down

    def set_down(self, address: str, cause: str, reason: str | None) -> None:
        """Mark the worker down for ``cause`` (``reason`` says why), or up again for that
        cause (``reason`` None). A down worker is not routed to from the next decision on."""
        w = self.workers.get(address)
        if w is None:
            return
        if reason is None:
            w.down.pop(cause, None)
        else:
            w.down[cause] = reason
        w.ready = w.declared_ready and not w.down

    def update_metrics(self, address: str, metrics: WorkerMetrics | None,
                       error: str | None = None) -> None:
        """Store a scrape. A failed scrape (``error``) marks the worker down at once: a worker
        that cannot answer /metrics (refused, reset, timed out) is not sent requests until
        it can; its old metrics are kept. A good scrape brings it back (it accepts
        connections again, so an Envoy connect failure is cleared too)."""
        w = self.workers.get(address)
        if w is None:
            return
        w.scrape_error = error
        if metrics is None:
            if error is not None:
                self.set_down(address, "scrape", f"scrape failed: {error}")
            return
        if "scrape" in w.down or "connect" in w.down:
            self.set_down(address, "scrape", None)
            self.set_down(address, "connect", None)
        if engine_restarted(w.metrics, metrics):
            # A new engine process at the same address: its cache is empty. Done before the
            # worker can be picked again (this scrape brings it back), so no request is
            # predicted a hit on a block the old process held.
            w.engine_restarts += 1
            self.directory.restarted(address, metrics.process_start)
        # The waiting requests beyond those this router had pending are someone else's.
        w.metrics = metrics = replace(metrics, router_pending=w.pending_requests,
                                      router_inflight=w.inflight)
        if metrics.waiting > 0:
            w.batch_cap_seen = max(w.batch_cap_seen, metrics.running)
        if metrics.num_blocks:
            engine_block = metrics.block_size or self.spec.block.block_size
            capacity = metrics.num_blocks * engine_block // self.spec.block.block_size
            self.directory.set_capacity(address, capacity)
        if metrics.slots:
            bs = self.spec.block.block_size
            slot_blocks = max(1, (metrics.slot_tokens or bs) // bs)
            cache = self.spec.prompt_cache
            self.directory.set_slots(
                address, metrics.slots, slot_blocks, entries=max(0, cache),
                max_blocks=metrics.slots * slot_blocks if cache < 0 else None,
                min_reuse=self.spec.min_reuse_tokens // bs,
                batch=max(1, self.spec.ubatch_tokens // bs))


def engine_restarted(old: WorkerMetrics | None, new: WorkerMetrics) -> bool:
    """A scrape says the engine is a new process: its start time changed (vLLM and other
    Python servers export prometheus_client's ``process_start_time_seconds``), or, where
    there is none, its cumulative prefix-cache counters went back."""
    if old is None:
        return False
    if old.process_start is not None and new.process_start is not None:
        return new.process_start != old.process_start
    return (old.prefix_queries is not None and new.prefix_queries is not None
            and new.prefix_queries < old.prefix_queries)
