"""The gateway's own Prometheus metrics (prometheus-client), on one registry per gateway."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cachepilot.core.router import Router

_LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
_ERROR_BUCKETS = (10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.decisions = Counter("cachepilot_decisions", "Routing decisions",
                                 ["pool", "policy", "outcome"], registry=r)
        self.decision_latency = Histogram("cachepilot_decision_latency_seconds",
                                          "Time to fingerprint, score and pick",
                                          ["pool"], buckets=_LATENCY_BUCKETS, registry=r)
        self.predicted_hits = Counter("cachepilot_predicted_hits",
                                      "Decisions predicted to hit a cached prefix",
                                      ["pool"], registry=r)
        self.hit_outcomes = Counter("cachepilot_hit_outcomes",
                                    "Predicted vs measured cache hits (from the worker's usage)",
                                    ["pool", "predicted", "measured"], registry=r)
        self.ttft_error = Histogram("cachepilot_ttft_prediction_error_ms",
                                    "|measured - predicted| time to first byte/token",
                                    ["pool"], buckets=_ERROR_BUCKETS, registry=r)
        self.errors = Counter("cachepilot_request_errors", "Requests answered with an error",
                              ["status"], registry=r)
        self.passthrough = Counter("cachepilot_passthrough_requests",
                                   "Non-inference requests sent to any ready worker", registry=r)
        labels = ["pool", "worker"]
        self.w_waiting = Gauge("cachepilot_worker_waiting", "Scraped waiting", labels, registry=r)
        self.w_running = Gauge("cachepilot_worker_running", "Scraped running", labels, registry=r)
        self.w_kv = Gauge("cachepilot_worker_kv_usage", "Scraped KV usage", labels, registry=r)
        self.w_inflight = Gauge("cachepilot_worker_inflight", "Routed, unfinished", labels,
                                registry=r)
        self.w_ready = Gauge("cachepilot_worker_ready", "1 when routable", labels, registry=r)
        self.w_blocks = Gauge("cachepilot_directory_blocks", "Blocks believed cached", labels,
                              registry=r)

    def refresh_workers(self, router: Router) -> None:
        """Copy per-worker state into gauges (called before each exposition)."""
        for g in (self.w_waiting, self.w_running, self.w_kv, self.w_inflight, self.w_ready,
                  self.w_blocks):
            g.clear()
        for pool in router.pools.values():
            blocks = pool.directory.stats()
            for addr, w in pool.workers.items():
                key = (pool.name, addr)
                m = w.metrics
                self.w_waiting.labels(*key).set(m.waiting if m else -1)
                self.w_running.labels(*key).set(m.running if m else -1)
                self.w_kv.labels(*key).set(m.kv_usage if m and m.kv_usage is not None else -1)
                self.w_inflight.labels(*key).set(w.inflight)
                self.w_ready.labels(*key).set(1 if w.ready else 0)
                self.w_blocks.labels(*key).set(blocks.get(addr, {}).get("blocks", 0))
