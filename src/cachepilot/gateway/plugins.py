"""The gateway's own lifecycle plugins: metrics and stall tracking.

They see what every other plugin sees (:mod:`cachepilot.core.lifecycle`), so the exchange
code never counts, records or watches anything by hand: it drives the lifecycle and these
react. Both are built once per gateway and passed to
:func:`cachepilot.records.plugins.lifecycle_plugins` as ``extra``.
"""

from __future__ import annotations

from typing import Any

from cachepilot.core.decision import Decision
from cachepilot.core.lifecycle import FIRST_TOKEN, Outcome, Plugin, Response
from cachepilot.core.pool import Pool
from cachepilot.core.request import InferenceRequest, RequestError
from cachepilot.gateway.gateway_metrics import GatewayMetrics


class MetricsPlugin(Plugin):
    """Decisions, their latency and predicted hits; errors answered without a worker; how
    each observed request ended (measured vs predicted TTFT and cached tokens)."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self._latency: dict[str, Any] = {}  # per pool: the latency histogram's child

    def on_routed(self, decision: Decision, pool: Pool) -> None:
        m = self.metrics
        hist = self._latency.get(decision.pool)
        if hist is None:
            hist = self._latency[decision.pool] = m.decision_latency.labels(decision.pool)
        if decision.latency_s:
            hist.observe(decision.latency_s)
        m.decisions.labels(decision.pool, decision.policy, "routed").inc()
        if decision.predicted_hit:
            m.predicted_hits.labels(decision.pool).inc()
        if decision.fallback is not None:
            m.exact_fallbacks.labels(decision.pool, decision.fallback).inc()
        if decision.turn_ms > 0:
            m.replica_turns.labels(decision.pool).inc()
            m.replica_turn_seconds.labels(decision.pool).inc(decision.turn_ms / 1000.0)

    def on_rejected(self, error: RequestError, request: InferenceRequest | None,
                    now: float) -> None:
        self.metrics.request_error(error.status)

    def on_finish(self, decision: Decision, outcome: Outcome) -> None:
        if not outcome.observed:
            return
        # Only a streamed response that was not aborted has a real first token.
        real = (outcome.ttft_kind == FIRST_TOKEN and not outcome.aborted
                and outcome.ttft_ms is not None)
        self.metrics.outcome(decision, status=outcome.status,
                             cached_tokens=outcome.cached_tokens,
                             first_token_s=outcome.ttft_ms / 1000.0 if real else None)


class StallTracker(Plugin):
    """Finds workers that stopped answering: routed requests without a first byte, by worker,
    and each worker's last first byte. A worker whose oldest request waited ``after_s`` while
    it answered nothing for as long has stalled (the server's watch loop takes it out of
    routing until that changes): slow is not stalled, silent is."""

    def __init__(self) -> None:
        self.awaiting: dict[str, dict[str, float]] = {}  # worker → decision id → routed at
        self.last_first_byte: dict[str, float] = {}

    def on_routed(self, decision: Decision, pool: Pool) -> None:
        self.awaiting.setdefault(decision.chosen, {})[decision.id] = decision.time

    def on_response(self, decision: Decision, response: Response) -> None:
        self.awaiting.get(decision.chosen, {}).pop(decision.id, None)
        if response.model_output:
            self.last_first_byte[decision.chosen] = response.at

    def on_finish(self, decision: Decision, outcome: Outcome) -> None:
        self.awaiting.get(decision.chosen, {}).pop(decision.id, None)

    def stalled(self, now: float, after_s: float) -> dict[str, str]:
        """Why each stalled worker is stalled, by worker."""
        out: dict[str, str] = {}
        for worker, waiting in self.awaiting.items():
            if not waiting:
                continue
            oldest = now - min(waiting.values())
            if oldest > after_s and now - self.last_first_byte.get(worker, 0.0) > after_s:
                out[worker] = (f"stalled: no first byte for {oldest:.1f}s "
                               f"({len(waiting)} requests waiting)")
        return out
