"""Flow control's Prometheus metrics: what is held, how long requests waited, how they left
(dispatched, by reason; refused, by reason; cancelled), and how far apart the tenants'
shares are.

Labels stay bounded: ``band`` is a priority (a handful per deployment), ``reason`` one of a
fixed list, and ``tenant`` one of the first ``metric_tenants`` tenants seen, every later one
counted as ``other`` (tenant ids come from request headers: unbounded otherwise).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cachepilot.core.decision import Decision
from cachepilot.core.flow.classify import FlowMeta
from cachepilot.core.flow.config import DEFAULT_TENANT
from cachepilot.core.flow.control import FlowControl, FlowError, FlowObserver
from cachepilot.core.flow.info import DISPATCH_REASONS, SHED_REASONS
from cachepilot.core.flow.queue import Ticket

# Time held, from a few ms (a capacity event away) to the default 20 s time to live.
_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
OTHER = "other"


class TenantLabels:
    """A tenant's label value: itself for the first ``limit`` tenants, then ``other``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._known: set[str] = set()

    def __call__(self, tenant: str) -> str:
        if tenant in self._known:
            return tenant
        if len(self._known) < self.limit:
            self._known.add(tenant)
            return tenant
        return OTHER


class FlowMetrics(FlowObserver):
    """Registered on the gateway's registry; observes one :class:`FlowControl`."""

    def __init__(self, registry: CollectorRegistry, flow: FlowControl) -> None:
        r = registry
        self.flow = flow
        self.tenant = TenantLabels(flow.config.metric_tenants)
        self.held = Gauge("cachepilot_flow_held_requests",
                          "Requests flow control holds now, by pool, band and tenant",
                          ["pool", "band", "tenant"], registry=r)
        self.oldest = Gauge("cachepilot_flow_oldest_held_seconds",
                            "How long the oldest held request of a band has waited",
                            ["pool", "band"], registry=r)
        self.lag = Gauge("cachepilot_flow_fairness_lag_tokens",
                         "Spread of the backlogged tenants' service counters in a band "
                         "(weighted tokens; bounded by bend_tokens plus one request)",
                         ["pool", "band"], registry=r)
        self.wait = Histogram("cachepilot_flow_wait_seconds",
                              "Time a routed request was held before dispatch (0: never held)",
                              ["pool", "band", "tenant"], buckets=_WAIT_BUCKETS, registry=r)
        self.dispatched = Counter("cachepilot_flow_dispatched",
                                  "Requests flow control routed, by how (direct: never held; "
                                  "fair, locality, holder, holder_timeout: after a hold)",
                                  ["pool", "band", "reason"], registry=r)
        self.refused = Counter("cachepilot_flow_refused",
                               "Requests flow control answered with 429 (or 503), by reason",
                               ["pool", "band", "reason"], registry=r)
        self.cancelled = Counter("cachepilot_flow_cancelled",
                                 "Held requests whose client left before dispatch",
                                 ["pool", "band"], registry=r)
        self._seen: set[str] = set()  # pools whose counters start at zero
        self._children: dict[tuple[str, int, str, str], tuple[object, object]] = {}

    # -- what flow control reports ----------------------------------------------------------
    def on_dispatched(self, d: Decision, now: float) -> None:
        f = d.flow
        if f is None:
            return
        # The children by their labels, cached: labels() costs more than the rest here.
        key = (d.pool, f.priority, f.tenant, f.dispatch)
        children = self._children.get(key)
        if children is None:
            band = str(f.priority)
            children = self._children[key] = (
                self.wait.labels(d.pool, band, self.tenant(f.tenant)),
                self.dispatched.labels(d.pool, band, f.dispatch))
            if len(self._children) > 10_000:  # many short-lived tenants: stay bounded
                self._children.clear()
        children[0].observe(f.held_ms / 1000.0)
        children[1].inc()

    def on_refused(self, pool: str, meta: FlowMeta, err: FlowError, held_s: float,
                   now: float) -> None:
        self.refused.labels(pool, str(meta.priority), err.reason).inc()

    def on_cancelled(self, t: Ticket, now: float) -> None:
        self.cancelled.labels(t.pool, str(t.meta.priority)).inc()

    # -- exposition -------------------------------------------------------------------------
    def refresh(self, now: float) -> None:
        """Copy the queues' state into the gauges (before each exposition). Every pool has
        its band 0 series, held or not, and every reason its counter from zero, so a
        dashboard has a line at zero rather than no data (Prometheus' advice for known
        label values)."""
        for g in (self.held, self.oldest, self.lag):
            g.clear()
        for pool in self.flow.router.pools:
            self.held.labels(pool, "0", DEFAULT_TENANT).set(0)
            self.oldest.labels(pool, "0").set(0)
            self.lag.labels(pool, "0").set(0)
            if pool not in self._seen:
                self._seen.add(pool)
                for reason in SHED_REASONS:
                    self.refused.labels(pool, "0", reason)
                for reason in DISPATCH_REASONS:
                    self.dispatched.labels(pool, "0", reason)
                self.cancelled.labels(pool, "0")
        for row in self.flow.snapshot(now):
            pool, band = row["pool"], str(row["priority"])
            for tenant, n in row["tenants"].items():
                self.held.labels(pool, band, self.tenant(tenant)).inc(n)
            self.oldest.labels(pool, band).set(row["oldest_s"])
            self.lag.labels(pool, band).set(row["lag_tokens"])
