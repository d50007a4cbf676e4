"""What the router knows about a worker: scraped engine metrics plus its own bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class WorkerMetrics:
    """One scrape of an engine's metrics, engine-neutral (vLLM names are the reference)."""

    waiting: int = 0
    running: int = 0
    kv_usage: float | None = None  # 0–1; None when the engine does not say (llama.cpp)
    block_size: int | None = None  # from vllm:cache_config_info
    num_blocks: int | None = None
    prefix_queries: float | None = None  # tokens, cumulative
    prefix_hits: float | None = None
    # Slot engines (llama.cpp): each slot keeps the KV of the last prompt it served, up to
    # its context. From the engine's /props; the directory then holds one chain per slot.
    slots: int | None = None
    slot_tokens: int | None = None
    # Prompt tokens the engine has already prefilled of the requests it is still prefilling
    # (llama.cpp: /slots, busy slots with no token decoded yet; the simulator: its engines),
    # when the scrape was taken. Work that is no longer ahead of a newcomer; the router sets
    # it to 0 at the worker's next first token (the report was about that request).
    prefill_done_tokens: int = 0
    # The engine's batch size (vLLM's max_num_seqs), when known (the simulator knows its
    # engines'; a live gateway would need it configured or exposed). Once that many
    # sequences run, a newcomer waits for one to finish. None: unknown.
    max_batch: int | None = None
    scraped_at: float = 0.0  # caller's clock
    # The engine process's start (Prometheus' process_start_time_seconds, Unix seconds):
    # a new value means a new process, whose cache is empty. None: not exported (vLLM with
    # several API servers, other engines).
    process_start: float | None = None
    # Requests this router had sent there without a first token when the scrape was stored
    # (set by Pool.update_metrics): the waiting requests beyond it are someone else's.
    router_pending: int = 0
    # This router's requests in flight there when the scrape was stored (set by
    # Pool.update_metrics): the occupancy beyond them is someone else's, and flow control's
    # gate counts its own live instead of trusting a scrape up to an interval old.
    router_inflight: int = 0


@dataclass(frozen=True, slots=True)
class TTFTParams:
    """One worker's TTFT model (see :mod:`cachepilot.core.cost`), all in ms."""

    base_ms: float
    prefill_ms_per_token: float
    ms_per_running: float
    ms_per_queued: float
    # Per place in line behind a full batch: a wait for a finishing sequence. 0 in records
    # written before it was learned (they never priced one separately).
    ms_per_batch_wait: float = 0.0

    def predict(self, x: tuple[float, ...]) -> float:
        return (self.base_ms * x[0] + self.prefill_ms_per_token * x[1]
                + self.ms_per_running * x[2] + self.ms_per_queued * x[3]
                + self.ms_per_batch_wait * x[4])


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """A worker as one decision priced it: what the router, the decision record and replay
    share. The router prices snapshots (never the live state, which later requests change);
    a record stores one per candidate; replay rebuilds a pool from them."""

    address: str
    ready: bool = True
    metrics: WorkerMetrics | None = None  # the scrape in force (its own clock: scraped_at)
    inflight: int = 0
    pending_requests: int = 0
    pending_prefill_tokens: int = 0
    batch_cap_seen: int = 0
    ttft: TTFTParams | None = None  # learned (None: the pool's prior)

    def metrics_age(self, now: float) -> float | None:
        return None if self.metrics is None else max(0.0, now - self.metrics.scraped_at)


@dataclass(slots=True)
class WorkerState:
    """A registered worker. ``inflight`` counts requests this router sent that have not
    finished: it sees a burst before the next scrape does."""

    address: str  # "ip:port", exactly what Envoy's ORIGINAL_DST cluster connects to
    # Routable: declared ready (pod readiness, or static) and not known to be down. Set
    # through Pool (upsert_worker, set_ready, set_down), which keeps the two in step.
    ready: bool = True
    declared_ready: bool = True
    # Why it is down, by cause ("scrape": its /metrics failed; "connect": Envoy could not
    # reach it; "stalled": its requests get no first byte). Empty: up.
    down: dict[str, str] = field(default_factory=dict)
    metrics: WorkerMetrics | None = None
    inflight: int = 0
    # When the last request this router sent here ended (the driver's clock): a slot engine
    # starts on the next request it holds then (cachepilot.core.router._slot_progress).
    freed_at: float = 0.0
    # Requests sent here whose first token has not come back, and their uncached prompt
    # tokens: prefill work ahead of a newcomer that no scrape has seen yet.
    pending_requests: int = 0
    pending_prefill_tokens: int = 0
    assigned: int = 0
    # Largest running count seen while requests waited: the engine's batch size, learned.
    batch_cap_seen: int = 0
    scrape_error: str | None = None
    engine_restarts: int = 0  # new engine processes its scrapes found (Pool.update_metrics)
    # This worker's learned TTFT model (cachepilot.core.predictor); None: the pool's prior.
    ttft: TTFTParams | None = None
    labels: dict[str, str] = field(default_factory=dict)

    def metrics_age(self, now: float) -> float | None:
        return None if self.metrics is None else max(0.0, now - self.metrics.scraped_at)

    def snapshot(self) -> WorkerSnapshot:
        return WorkerSnapshot(self.address, self.ready, self.metrics, self.inflight,
                              self.pending_requests, self.pending_prefill_tokens,
                              self.batch_cap_seen, self.ttft)

    @classmethod
    def from_snapshot(cls, s: WorkerSnapshot) -> WorkerState:
        """A worker in the state a decision saw it (replay)."""
        return cls(address=s.address, ready=s.ready, declared_ready=s.ready, metrics=s.metrics,
                   inflight=s.inflight, pending_requests=s.pending_requests,
                   pending_prefill_tokens=s.pending_prefill_tokens,
                   batch_cap_seen=s.batch_cap_seen, ttft=s.ttft)
