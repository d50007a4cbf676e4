"""A routing decision with every candidate's terms: enough to explain and replay it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cachepilot.core.request import InferenceRequest, RequestError
from cachepilot.core.workers import WorkerSnapshot

if TYPE_CHECKING:
    from cachepilot.core.flow.info import FlowInfo


class RoutingError(RequestError):
    """No worker can take the request: 503 (none healthy) or 429 (all full)."""


@dataclass(slots=True)
class Candidate:
    """One worker as a decision priced it: its state (a snapshot), the features read from
    it, and every priced term in ms."""

    worker: str
    state: WorkerSnapshot  # what the worker looked like to this decision (replay rebuilds it)
    eligible: bool = True
    # Why not eligible: "not_ready", "stale", "full", "subset"; flow control's "closed" (the
    # worker's queue is at the gate's depth) and "slo" (predicted to miss the request's TTFT
    # target while another meets it).
    filtered: str | None = None
    matched_blocks: int = 0
    matched_tokens: int = 0
    waiting: int = 0
    running: int = 0
    queued: int = 0  # requests waiting for admission ahead of it (a feature)
    batch_waits: int = 0  # places in line behind a full batch, its own included (a feature)
    ahead_tokens: int = 0  # prefill tokens queued ahead of it (a feature; see core.cost)
    kv_usage: float = 0.0
    metrics_age_ms: float | None = None
    # Priced terms, all in ms of TTFT.
    saved_ms: float = 0.0
    prefill_ms: float = 0.0
    queue_ms: float = 0.0
    kv_ms: float = 0.0
    # Not part of this request's TTFT: the delay its prefill adds to later arrivals at that
    # worker (cachepilot.core.cost.congestion_ms_of). The priced policy counts it.
    congestion_ms: float = 0.0
    # Also for later requests, on slot engines: the expected reused blocks this placement
    # would make homeless (cachepilot.core.directory.PrefixDirectory.eviction_blocks), and
    # their prefill in ms. The priced policy counts it.
    evict_blocks: float = 0.0
    eviction_ms: float = 0.0
    predicted_ttft_ms: float = 0.0
    value: float = 0.0  # what the policy maximised

    @property
    def inflight(self) -> int:
        """Requests this router had sent there that had not finished."""
        return self.state.inflight

    @property
    def pending_prefill_tokens(self) -> int:
        return self.state.pending_prefill_tokens


@dataclass(slots=True)
class Decision:
    id: str
    time: float
    pool: str
    model: str
    policy: str
    weights: dict[str, float]
    seq: int
    tokens: int
    block_size: int
    hashes: tuple[int, ...]
    candidates: list[Candidate]
    chosen: str
    margin_ms: float
    reason: str
    # Set by the router: the chosen worker's uncached tokens, counted as pending prefill
    # there until first_token() or release().
    uncached_tokens: int = 0
    prefill_pending: bool = False
    finished: bool = False  # released: the lifecycle's end has been reported
    vacated: bool = False  # its worker counts it no more (Router.vacate or release)
    arrival_rate: float = 0.0  # the pool's recent requests/s, which prices congestion
    typical_uncached: float = 0.0  # what a waiting request someone else sent is assumed to be
    # What the driver routed (never recorded: the prompt stays out of records unless the
    # recording plugin is told to capture it). None when replayed from a record.
    request: InferenceRequest | None = field(default=None, repr=False, compare=False)
    # Seconds from the driver's start (parse included) to the booked decision; 0 unknown.
    latency_s: float = 0.0
    # Why this request fell back from the pool's exact (engine-hash) directory to the
    # approximate one (cachepilot.core.vllm_prompt); None: it did not.
    fallback: str | None = None
    # Flow control's part: the request's tenant and band, how long it was held and why.
    flow: FlowInfo | None = None
    # How long this replica held the request for its turn on a long prompt before routing
    # it (ms; core.spread); 0: not held.
    turn_ms: float = 0.0
    # Dispatched to the busy prefix holder flow control held it for: that worker as priced
    # when the hold began, and the ms from then to this decision (never recorded). The
    # predictor learns from it what a wait for a busy worker takes (held requests never
    # queue in the engine, so the decision's own features cannot show it).
    holder_priced: Candidate | None = field(default=None, repr=False, compare=False)
    holder_waited_ms: float = 0.0

    @property
    def winner(self) -> Candidate:
        return next(c for c in self.candidates if c.worker == self.chosen)

    @property
    def predicted_hit(self) -> bool:
        return self.winner.matched_blocks > 0
