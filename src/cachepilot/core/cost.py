"""The cost model: the time to first token (TTFT) a request would see on each worker, in ms.

A worker's predicted TTFT for a request is a linear model of what stands between the request
and its first token there (:func:`ahead_of`)::

    ttft ≈ base + prefill_ms_per_token × (its uncached tokens + prefill queued ahead of it)
                + ms_per_running × sequences decoding in the batch it joins
                + ms_per_queued × requests waiting for admission ahead of it
                + ms_per_batch_wait × places in line behind a full batch (itself included)
                + KV pressure

"Prefill queued ahead" is what this router sent there that has not produced a first token
yet, less what the engine reports it has already prefilled of it (:func:`prefill_done`),
plus a typical request's prefill for each waiting request someone else sent (another
client, another gateway replica); waiting requests are the scraped queue plus those sent
since the scrape that the batch cannot have taken.
Defaults describe a 7–8B model in bf16 on one datacenter GPU (A100/H100 class) under vLLM:
prefill at ~12k tokens/s (0.08 ms/token), a ~15 ms scheduler step, ~0.1 ms per decoding
sequence per step. They are the prior: :mod:`cachepilot.core.predictor` learns each worker's
parameters (:class:`TTFTParams`) from measured TTFTs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from cachepilot.core.workers import TTFTParams, WorkerMetrics, WorkerSnapshot


@dataclass(frozen=True, slots=True)
class CostModel:
    prefill_ms_per_token: float = 0.08
    base_ttft_ms: float = 15.0
    # Admission of a request waiting ahead, beyond its prefill: a few scheduler steps while
    # the token budget is the limit, far more when the batch is full. The predictor learns
    # each worker's; this prior leans to caution, as a queue is how a worker in trouble looks.
    queue_ms_per_waiting: float = 50.0
    # Decode steps of running sequences share each step with our prefill: ~0.1 ms per
    # sequence per step, over the one or two steps a prefill takes.
    queue_ms_per_running: float = 0.2
    # Above this KV usage, evictions (lost prefixes) and preemptions become likely…
    kv_threshold: float = 0.8
    # …costing up to this much at a full cache (a recompute of a preempted request).
    kv_penalty_ms: float = 1000.0
    # Weight of the delay a request's prefill adds to later arrivals at its worker
    # (congestion_ms): 1.0 prices it at its expected value; 0 ignores it.
    congestion_weight: float = 1.0
    # Metrics older than this are not trusted: the worker is treated as saturated.
    stale_after_s: float = 5.0
    # Requests waiting on one worker beyond which it takes no more (→ 429 when all are full).
    admission_limit: int = 128
    # The engine's batch size (vLLM's max_num_seqs); 0: learn it from scrapes that show a
    # queue. Requests sent since the last scrape fill the batch first, then queue.
    max_batch: int = 0
    # With the batch full (its size known: max_batch, the engine's WorkerMetrics.max_batch,
    # a slot engine's slots), each request waiting ahead, and the newcomer, also waits for a
    # sequence to finish, not just a scheduler step: this much per place in line. Only the
    # prior, and learned apart from ms_per_queued (token-budget queues, the common kind,
    # would otherwise set both): each worker's comes from its own full batches. The prior is
    # one more admission wait (a batch of B sequences of ~B output tokens frees a place about
    # every step); the predictor moves it to seconds on a one-slot engine.
    full_batch_wait_ms: float = 50.0

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    def with_(self, **changes: float) -> CostModel:
        return replace(self, **changes)

    @property
    def ttft(self) -> TTFTParams:
        """The prior of every worker's TTFT model."""
        return TTFTParams(self.base_ttft_ms, self.prefill_ms_per_token,
                          self.queue_ms_per_running, self.queue_ms_per_waiting,
                          self.full_batch_wait_ms)


@dataclass(frozen=True, slots=True)
class Weights:
    """Multipliers on the priced terms; 1.0 everywhere means "trust the milliseconds"."""

    prefill: float = 1.0
    load: float = 1.0
    kv: float = 1.0

    def to_dict(self) -> dict[str, float]:
        # Every decision records its weights: a literal, as asdict() costs ~20 µs.
        return {"prefill": self.prefill, "load": self.load, "kv": self.kv}


def parse_overrides(text: str | None, cls: type, what: str) -> dict[str, float]:
    """``"prefill=1,load=2"`` → {"prefill": 1.0, "load": 2.0} for the fields of ``cls``
    (:class:`Weights` or :class:`CostModel`); an integer field stays an integer. An unknown
    name, a bad number or a fraction for an integer field is a ValueError that says what was
    expected."""
    allowed = {f.name for f in fields(cls)}
    defaults = cls()
    out: dict[str, float] = {}
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in allowed:
            raise ValueError(f"bad {what} {part!r}: expected NAME=NUMBER with NAME one of "
                             f"{', '.join(sorted(allowed))}")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"bad {what} {part!r}: {value!r} is not a number") from None
        if isinstance(getattr(defaults, name), int):
            if not number.is_integer():
                raise ValueError(f"bad {what} {part!r}: {value!r} is not a whole number")
            number = int(number)
        out[name] = number
    return out


def parse_weights(text: str | None) -> dict[str, float]:
    return parse_overrides(text, Weights, "weight")


def parse_cost(text: str | None) -> dict[str, float]:
    return parse_overrides(text, CostModel, "cost parameter")


@dataclass(frozen=True, slots=True)
class Load:
    """A worker's load as the router believes it, stale metrics already made pessimistic."""

    waiting: int
    running: int
    kv_usage: float
    stale: bool
    age_s: float | None


def effective_load(worker: WorkerSnapshot, now: float, cost: CostModel) -> Load:
    """The scraped queue plus requests this router sent that the scrape has not seen yet;
    missing or stale metrics → saturated, never idle (an unobserved worker is the one most
    likely to be in trouble)."""
    m: WorkerMetrics | None = worker.metrics
    age = worker.metrics_age(now)
    if m is None or age is None or age > cost.stale_after_s:
        return Load(waiting=max(cost.admission_limit, worker.inflight), running=0,
                    kv_usage=1.0, stale=True, age_s=age)
    unseen = max(0, worker.inflight - (m.waiting + m.running))
    cap = cost.max_batch or worker.batch_cap_seen
    joined = unseen if not cap else min(unseen, max(0, cap - m.running))
    return Load(waiting=m.waiting + unseen - joined, running=m.running + joined,
                kv_usage=m.kv_usage if m.kv_usage is not None else 0.0, stale=False, age_s=age)


def ahead_of(load: Load, worker: WorkerSnapshot, typical_uncached: float,
             cost: CostModel) -> tuple[int, int, int]:
    """What is ahead of a new request on ``worker``: (prefill tokens, requests waiting for
    admission, places in line behind a full batch). Waiting requests count in the first two
    on purpose: their prefill (exact for those this router sent; a typical request's for the
    others the last scrape saw) and their admission (a scheduler step or two while the token
    budget is the limit), each priced per worker by the predictor. Once the batch is full
    (its size known), every one of them, and the newcomer, also waits for a sequence to
    finish: the third count, priced apart (``ms_per_batch_wait``)."""
    m = worker.metrics
    foreign = 0 if m is None else max(0, m.waiting - m.router_pending)
    ahead = (worker.pending_prefill_tokens - prefill_done(worker)
             + round(foreign * typical_uncached))
    # Only a configured batch size says the batch is full: the size learned from scrapes
    # (batch_cap_seen) is often lower, since engines with chunked prefill queue requests for
    # the token budget long before every batch slot is taken.
    # A slot engine says its batch size (llama.cpp's slots): a busy slot is a full batch;
    # a batch engine's, when known (WorkerMetrics.max_batch), says the same.
    cap = cost.max_batch or (0 if m is None else m.max_batch or m.slots or 0)
    full = bool(cap) and load.running >= cap
    return ahead, load.waiting, load.waiting + 1 if full else 0


def prefill_done(worker: WorkerSnapshot) -> int:
    """The part of the prefill this router sent there that the engine says it has done
    already (:attr:`WorkerMetrics.prefill_done_tokens`, as of the scrape): a request for a
    document another request is still prefilling waits only for the rest. A batch engine's
    is as reported (a scrape, KV events), never extrapolated: it shares its steps with other
    work, so a drain rate would be a guess. A slot engine's runs on with the clock between
    its readings, at the worker's own learned rate
    (:func:`cachepilot.core.router._slot_progress`)."""
    m = worker.metrics
    return 0 if m is None else max(0, min(m.prefill_done_tokens, worker.pending_prefill_tokens))


def queue_ms(ahead_tokens: int, running: int, queued: int, batch_waits: int,
             p: TTFTParams) -> float:
    """Everything ahead of the request: queued prefill, decode interference, admission."""
    return (ahead_tokens * p.prefill_ms_per_token + running * p.ms_per_running
            + queued * p.ms_per_queued + batch_waits * p.ms_per_batch_wait)


def congestion_ms_of(prefill_ms: float, arrivals_per_ms: float, backlog_ms: float,
                     cost: CostModel) -> float:
    """The delay a prefill of ``prefill_ms`` adds to the requests that arrive at the worker
    before it is done: those arriving while the backlog ahead of it drains (about
    ``λ·backlog``) wait all of it, those arriving during it (``λ·prefill``) half on
    average. Not part of this request's TTFT, but paid by the next ones: a placement that
    recomputes a prefix cached elsewhere costs the pool capacity, and most on a worker that
    is already behind (a burst, a cold start), where every later arrival pays it."""
    return (cost.congestion_weight * arrivals_per_ms * prefill_ms
            * (backlog_ms + prefill_ms / 2.0))


def kv_pressure_ms(load: Load, new_blocks: int, worker: WorkerSnapshot, cost: CostModel) -> float:
    """Grows quadratically from the threshold to a full cache, counting the blocks this
    request would add where the worker's block count is known."""
    usage = load.kv_usage
    total = worker.metrics.num_blocks if worker.metrics else None
    if total:
        usage += new_blocks / total
    if usage <= cost.kv_threshold:
        return 0.0
    x = min(usage, 1.5) - cost.kv_threshold
    return cost.kv_penalty_ms * (x / (1.0 - cost.kv_threshold)) ** 2
