"""The gateway's own Prometheus metrics (prometheus-client), on one registry per gateway.

Names follow Prometheus' conventions (https://prometheus.io/docs/practices/naming/): base
units (seconds, ratios 0–1), ``_total`` on every counter (prometheus-client appends it to the
names below), ``_seconds`` on every duration histogram, and labels of bounded cardinality only
(pool, policy, worker, mode, code, …: never a request, a decision or a prefix).
``tests/gateway/test_metrics_gateway.py`` lints every exported name; docs/observability.md is the
reference table.

Per-worker state (scraped load, the directory, the KV-event streams) is copied from the router
and the KV-event hub at each exposition (:meth:`GatewayMetrics.refresh_workers`); the KV-event
counters are the hub's own, exposed as counters by a collector (they restart from zero when a
worker's subscription does, which ``rate()`` treats as a counter reset).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from cachepilot.core.decision import Decision
from cachepilot.core.directory import MODES
from cachepilot.core.router import Router

_LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
# Time to first token, predicted and measured, and the predictor's absolute error (seconds):
# vLLM's TTFT buckets from 5 ms to 40 s, fine enough below 100 ms for a warm prefix's quantiles.
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0)
_ERROR_BUCKETS = _TTFT_BUCKETS

# KV-event stream counters (cachepilot.core.kv_events.StreamCounters, and the hub's count of
# malformed frames) → (metric name without _total, help).
KV_EVENT_COUNTERS: dict[str, tuple[str, str]] = {
    "gaps": ("cachepilot_kv_event_gaps", "Sequence gaps seen on a worker's live KV-event stream"),
    "replays": ("cachepilot_kv_event_replays",
                "Replay requests sent to a worker's KV-event publisher (gap fills, late joins)"),
    "holes": ("cachepilot_kv_event_holes", "KV-event gaps no replay could fill"),
    "restarts": ("cachepilot_kv_event_publisher_restarts",
                 "KV-event publisher restarts seen (sequence numbers went back)"),
    "malformed": ("cachepilot_kv_event_malformed_frames",
                  "KV-event frames that could not be decoded, skipped"),
    "unreadable": ("cachepilot_kv_event_unreadable_events",
                          "KV events of a type or shape the gateway cannot read (the "
                          "worker's event history gets a hole: degraded)"),

    "batches": ("cachepilot_kv_event_batches", "KV-event batches applied to the directory"),
}


class _KVEventCollector(Collector):
    """The hub's per-worker counters, as of the last :meth:`GatewayMetrics.refresh_workers`."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, Mapping[str, Any]]] = []  # (pool, worker, status)

    def collect(self) -> Iterator[CounterMetricFamily]:
        for key, (name, doc) in KV_EVENT_COUNTERS.items():
            fam = CounterMetricFamily(name, doc, labels=["pool", "worker"])
            for pool, worker, st in self.rows:
                fam.add_metric([pool, worker], float(st.get(key, 0) or 0))
            yield fam

    def describe(self) -> Iterator[CounterMetricFamily]:
        # Names only: no collect() at registration (the rows do not exist yet).
        for name, doc in KV_EVENT_COUNTERS.values():
            yield CounterMetricFamily(name, doc, labels=["pool", "worker"])


class _RestartCollector(Collector):
    """Engine restarts each worker's scrapes found (a new process at the same address: its
    blocks were dropped from the directory), as of the last refresh."""

    NAME = "cachepilot_engine_restarts"
    DOC = ("Engine restarts a worker's scrapes found (process_start_time_seconds changed, or "
           "its counters went back): the directory dropped its blocks")

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, int]] = []

    def collect(self) -> Iterator[CounterMetricFamily]:
        fam = CounterMetricFamily(self.NAME, self.DOC, labels=["pool", "worker"])
        for pool, worker, n in self.rows:
            fam.add_metric([pool, worker], float(n))
        yield fam

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.NAME, self.DOC, labels=["pool", "worker"])


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        # -- routing --------------------------------------------------------------------------
        self.decisions = Counter("cachepilot_decisions", "Routing decisions",
                                 ["pool", "policy", "outcome"], registry=r)
        self.decision_latency = Histogram("cachepilot_decision_latency_seconds",
                                          "Time to fingerprint, score and pick",
                                          ["pool"], buckets=_LATENCY_BUCKETS, registry=r)
        self.predicted_hits = Counter("cachepilot_predicted_hits",
                                      "Decisions predicted to hit a cached prefix",
                                      ["pool"], registry=r)
        self.exact_fallbacks = Counter(
            "cachepilot_exact_fallbacks",
            "Requests in a pool hashing as its vLLM engines do whose prompt could not be "
            "reproduced exactly, matched on the approximate directory instead, by reason",
            ["pool", "reason"], registry=r)
        self.replica_turns = Counter(
            "cachepilot_replica_turns",
            "Long uncached prompts this replica held for its turn before routing them (the "
            "replicas before it placed theirs first: docs/guides/replicas.md)", ["pool"],
            registry=r)
        self.replica_turn_seconds = Counter(
            "cachepilot_replica_turn_seconds",
            "Time those requests waited for their turn, summed", ["pool"], registry=r)
        # -- outcomes: prediction vs measurement ----------------------------------------------
        self.hit_outcomes = Counter("cachepilot_hit_outcomes",
                                    "Predicted vs measured cache hits (from the worker's usage)",
                                    ["pool", "predicted", "measured"], registry=r)
        self.prompt_tokens = Counter(
            "cachepilot_prompt_tokens",
            "Prompt tokens (as the gateway counts them) of requests whose cached tokens the "
            "worker reported: the denominator of both token hit rates", ["pool"], registry=r)
        self.predicted_cached_tokens = Counter(
            "cachepilot_predicted_cached_tokens",
            "Prompt tokens the directory predicted cached on the chosen worker (same requests)",
            ["pool"], registry=r)
        self.cached_tokens = Counter(
            "cachepilot_cached_tokens",
            "Prompt tokens the worker reported served from its cache (usage.cached_tokens)",
            ["pool"], registry=r)
        self.ttft = Histogram("cachepilot_ttft_seconds",
                              "Measured time to first token of streamed responses",
                              ["pool"], buckets=_TTFT_BUCKETS, registry=r)
        self.ttft_predicted = Histogram(
            "cachepilot_ttft_predicted_seconds",
            "Predicted time to first token on the chosen worker, of the same responses",
            ["pool"], buckets=_TTFT_BUCKETS, registry=r)
        self.ttft_error = Histogram("cachepilot_ttft_prediction_error_seconds",
                                    "|measured - predicted| time to first token",
                                    ["pool"], buckets=_ERROR_BUCKETS, registry=r)
        self.errors = Counter("cachepilot_request_errors",
                              "Requests answered with an HTTP error, by status code and by "
                              "who answered (gateway: its own reply; upstream: a worker's)",
                              ["code", "source"], registry=r)
        self.passthrough = Counter("cachepilot_passthrough_requests",
                                   "Non-inference requests sent to any ready worker", registry=r)
        # -- per worker (copied at each exposition) -------------------------------------------
        labels = ["pool", "worker"]
        self.w_waiting = Gauge("cachepilot_worker_requests_waiting",
                               "Requests waiting at the worker (last scrape)", labels, registry=r)
        self.w_running = Gauge("cachepilot_worker_requests_running",
                               "Requests running at the worker (last scrape)", labels, registry=r)
        self.w_kv = Gauge("cachepilot_worker_kv_cache_usage_ratio",
                          "KV-cache usage of the worker, 0-1 (last scrape)", labels, registry=r)
        self.w_inflight = Gauge("cachepilot_worker_requests_in_flight",
                                "Requests this gateway routed there that have not finished",
                                labels, registry=r)
        self.w_pending = Gauge("cachepilot_worker_pending_prefill_tokens",
                               "Prefill tokens routed there that have no first token yet",
                               labels, registry=r)
        self.w_ready = Gauge("cachepilot_worker_ready", "1 when routable", labels, registry=r)
        self.w_blocks = Gauge("cachepilot_directory_blocks",
                              "Blocks the directory believes the worker holds", labels,
                              registry=r)
        self.w_mode = Gauge("cachepilot_directory_mode",
                            "The worker's directory mode: 1 for the current one, 0 for the "
                            "others (exact: KV events; degraded: events with a hole; "
                            "approximate: routing-learned)", [*labels, "mode"], registry=r)
        self._gauges = (self.w_waiting, self.w_running, self.w_kv, self.w_inflight,
                        self.w_pending, self.w_ready, self.w_blocks, self.w_mode)
        self._kv_events = _KVEventCollector()
        r.register(self._kv_events)
        self._restarts = _RestartCollector()
        r.register(self._restarts)

    # -- what the processor reports ---------------------------------------------------------
    def request_error(self, code: int, source: str = "gateway") -> None:
        self.errors.labels(str(code), source).inc()

    def outcome(self, d: Decision, *, status: int | None, first_token_s: float | None,
                cached_tokens: int | None) -> None:
        """A routed request finished: its worker's HTTP status, its measured first token
        (streamed, not aborted; else None) and the cached tokens the worker reported."""
        pool = d.pool
        if status is not None and status >= 400:
            self.request_error(status, "upstream")
        winner = d.winner
        if first_token_s is not None:
            predicted_s = winner.predicted_ttft_ms / 1000.0
            self.ttft.labels(pool).observe(first_token_s)
            self.ttft_predicted.labels(pool).observe(predicted_s)
            self.ttft_error.labels(pool).observe(abs(first_token_s - predicted_s))
        if cached_tokens is not None:
            self.hit_outcomes.labels(pool, str(d.predicted_hit).lower(),
                                     str(cached_tokens > 0).lower()).inc()
            self.prompt_tokens.labels(pool).inc(d.tokens)
            self.predicted_cached_tokens.labels(pool).inc(min(winner.matched_tokens, d.tokens))
            self.cached_tokens.labels(pool).inc(cached_tokens)

    # -- exposition -------------------------------------------------------------------------
    def refresh_workers(self, router: Router,
                        kv_events: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        """Copy per-worker state into gauges, and the KV-event hub's ``status()`` into its
        counters (called before each exposition). A worker without a scrape yet has no
        waiting/running/KV-usage series (absent, not a sentinel value)."""
        for g in self._gauges:
            g.clear()
        rows = []
        restarts = []
        for pool in router.pools.values():
            blocks = pool.directory.stats()
            for addr, w in pool.workers.items():
                key = (pool.name, addr)
                m = w.metrics
                if m is not None:
                    self.w_waiting.labels(*key).set(m.waiting)
                    self.w_running.labels(*key).set(m.running)
                    if m.kv_usage is not None:
                        self.w_kv.labels(*key).set(m.kv_usage)
                self.w_inflight.labels(*key).set(w.inflight)
                self.w_pending.labels(*key).set(w.pending_prefill_tokens)
                self.w_ready.labels(*key).set(1 if w.ready else 0)
                self.w_blocks.labels(*key).set(blocks.get(addr, {}).get("blocks", 0))
                current = pool.directory.mode(addr)
                for mode in MODES:
                    self.w_mode.labels(*key, mode).set(1 if mode == current else 0)
                if kv_events and addr in kv_events:
                    rows.append((pool.name, addr, kv_events[addr]))
                restarts.append((pool.name, addr, w.engine_restarts))
        self._kv_events.rows = rows
        self._restarts.rows = restarts
