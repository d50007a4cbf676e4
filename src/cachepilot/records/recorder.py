"""The decision log's writer: never blocks, never raises on overload. The gateway and the
simulator reach it through the recording lifecycle plugin
(:class:`cachepilot.records.plugins.RecordingPlugin`), with the core's typed ``Decision`` and
``Outcome``.

``decision()`` and ``outcome()`` only append an item to a bounded buffer; a background thread
drains it every ``linger_s`` in one batch, one LMDB transaction per batch, and applies
retention; with nothing to write, its tick backs off to ``idle_tick_s``. The request path
never wakes that thread: a ``queue.Queue`` put notifies its waiting consumer, which then
contends for the GIL just as the gateway sends its answer (5 % of the gateway's samples
under py-spy, docs/overhead.md); a deque append is one atomic C call. When the buffer is
full the item is dropped, counted in ``cachepilot_decision_records_dropped_total`` and
logged (first drop, then at most every 10 s). Under normal load nothing is dropped: one
transaction writes hundreds of records in a few ms.

Metrics go to the default registry unless a ``registry`` is given (the gateway's own).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections import deque
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from cachepilot.core.decision import Decision
from cachepilot.core.lifecycle import Outcome
from cachepilot.core.pool import Pool
from cachepilot.records.schema import decision_to_record, outcome_fields
from cachepilot.records.store import (
    DEFAULT_MAX_AGE_S,
    DEFAULT_MAX_BYTES,
    Store,
    register_open,
    unregister_open,
)

log = logging.getLogger("cachepilot.records")


class RecorderMetrics:
    """The recorder's Prometheus metrics, once per registry (the gateway passes its own)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.written = Counter("cachepilot_decision_records_written",
                               "Decision records and outcomes committed to the decision log",
                               ["kind"], registry=registry)
        self.dropped = Counter("cachepilot_decision_records_dropped",
                               "Decision records or outcomes not written, by reason "
                               "(queue_full: the writer could not keep up)", ["kind", "reason"],
                               registry=registry)
        self.queue = Gauge("cachepilot_decision_record_queue",
                           "Items waiting for the decision log writer", registry=registry)


_METRICS: dict[int, tuple[CollectorRegistry, RecorderMetrics]] = {}
_METRICS_LOCK = threading.Lock()


def recorder_metrics(registry: CollectorRegistry | None = None) -> RecorderMetrics:
    registry = REGISTRY if registry is None else registry
    with _METRICS_LOCK:
        hit = _METRICS.get(id(registry))
        if hit is None or hit[0] is not registry:
            hit = _METRICS[id(registry)] = (registry, RecorderMetrics(registry))
        return hit[1]


_STOP = object()


class Recorder:
    """Records decisions and their outcomes to an LMDB decision log at ``path``.

    ``decision(d, pool, prompt=...)`` once routed; ``outcome(id, outcome)`` once it ended
    (reports for one id merge); ``close()`` at shutdown (also registered with atexit)."""

    def __init__(self, path: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES,
                 max_age_s: float | None = DEFAULT_MAX_AGE_S, queue_size: int = 8192,
                 batch_size: int = 512, durable: bool = True, capture_prompts: bool = False,
                 source: str = "gateway", retention_interval_s: float = 1.0, linger_s: float = 0.02,
                 idle_tick_s: float = 0.5,
                 registry: CollectorRegistry | None = None, router: Any = None) -> None:
        self.store = Store(path, max_bytes=max_bytes, max_age_s=max_age_s, durable=durable)
        self.path = self.store.path
        self.capture_prompts = capture_prompts
        self.source = source
        self.batch_size = batch_size
        # The writer drains the buffer this often: one LMDB transaction (and, durable, one
        # fsync) per 20 ms at most, and few moments when the writer thread holds the GIL the
        # gateway's event loop wants.
        self.linger_s = linger_s
        # An idle writer backs off, its tick doubling up to this: 50 wake-ups a second with
        # nothing to write were most of an idle gateway's CPU (docs/real-model.md, "Fifth
        # runs"). The first record after a quiet spell waits at most this long to be written.
        self.idle_tick_s = max(linger_s, idle_tick_s)
        self.retention_interval_s = retention_interval_s
        self.written = {"decision": 0, "outcome": 0}
        self.dropped: dict[str, int] = {}
        self.queue_size = queue_size
        self._q: deque[Any] = deque()  # append / popleft are atomic: no lock needed
        self._wake = threading.Event()  # flush and close: drain now, not at the next tick
        self._closed = False
        self._last_drop_log = 0.0
        self._drops_since_log = 0
        self._cost_cache: tuple[Any, dict[str, Any]] | None = None
        self.metrics = recorder_metrics(registry)
        self.router = router  # decision() without a pool looks the pool up here
        self._lock = threading.Lock()
        if capture_prompts:
            log.warning("decision log %s: prompt capture is ON: raw prompt text is stored "
                        "with every decision record", self.path)
        register_open(self.store)
        self._thread = threading.Thread(target=self._run, name="cachepilot-decision-log",
                                        daemon=True)
        self._thread.start()
        atexit.register(self.close)

    # -- request path ---------------------------------------------------------------------
    def decision(self, decision: Decision, pool: Pool | None = None, *,
                 prompt: str | None = None) -> bool:
        """Queue a decision. ``pool`` (the routing Pool; by default the one of ``router`` given
        at construction) adds its cost model, so replay can re-price; ``prompt`` is kept
        only with capture on. Returns False if it was dropped."""
        if self._closed:
            return self._drop("decision", "closed")
        if pool is None and self.router is not None:
            pool = self.router.pools.get(decision.pool)
        cost = None if pool is None else self._cost_dict(pool.spec.cost)
        item = ("decision", decision, cost,
                prompt if self.capture_prompts else None, time.time())
        return self._put(item, "decision")

    def outcome(self, decision_id: str, outcome: Outcome) -> bool:
        """Queue how a recorded decision ended. Reports for one id merge (later fields win).
        Returns False if it was dropped."""
        if self._closed:
            return self._drop("outcome", "closed")
        return self._put(("outcome", decision_id, outcome), "outcome")

    def _cost_dict(self, cost: Any) -> dict[str, Any]:
        cached = self._cost_cache
        if cached is None or cached[0] is not cost:
            cached = self._cost_cache = (cost, cost.to_dict())
        return cached[1]

    def _put(self, item: Any, kind: str) -> bool:
        if len(self._q) >= self.queue_size:
            return self._drop(kind, "queue_full")
        self._q.append(item)
        return True

    def _drop(self, kind: str, reason: str) -> bool:
        self.metrics.dropped.labels(kind=kind, reason=reason).inc()
        key = f"{kind}:{reason}"
        with self._lock:
            self.dropped[key] = self.dropped.get(key, 0) + 1
            self._drops_since_log += 1
            now = time.monotonic()
            if now - self._last_drop_log < 10.0 and self._last_drop_log:
                return False
            n, self._drops_since_log, self._last_drop_log = self._drops_since_log, 0, now
        log.warning("decision log %s: dropped %d record(s) (%s %s; totals %s)", self.path, n,
                    kind, reason, dict(self.dropped))
        return False

    # -- writer thread ----------------------------------------------------------------------
    def _run(self) -> None:
        last_retention = time.monotonic()
        stop = False
        tick = self.linger_s
        while not stop:
            if len(self._q) < self.batch_size:  # a full batch goes at once, the rest per tick
                self._wake.wait(tick)
                self._wake.clear()
            # Records since the last tick: back to lingering; none: back off.
            tick = self.linger_s if self._q else min(2 * tick, self.idle_tick_s)
            items = []
            while self._q and len(items) < self.batch_size:
                items.append(self._q.popleft())
            self.metrics.queue.set(len(self._q))
            ops: list[tuple[str, Any]] = []
            events: list[threading.Event] = []
            for item in items:
                if item is _STOP:
                    stop = True
                elif isinstance(item, threading.Event):
                    events.append(item)
                elif item[0] == "decision":
                    _, d, cost, prompt, at = item
                    try:
                        ops.append(("decision", decision_to_record(
                            d, capture_prompt=prompt, cost=cost,
                            source=self.source, recorded_at=at)))
                    except Exception:
                        log.exception("decision log: cannot encode decision %s", d.id)
                        self._drop("decision", "error")
                else:
                    ops.append(("outcome", (item[1], outcome_fields(item[2]))))
            if ops:
                self._commit(ops)
            if time.monotonic() - last_retention >= self.retention_interval_s:
                last_retention = time.monotonic()
                try:
                    self.store.prune()
                except Exception:
                    log.exception("decision log %s: retention failed", self.path)
            for ev in events:
                ev.set()

    def _commit(self, ops: list[tuple[str, Any]]) -> None:
        try:
            res = self.store.write(ops=ops)
        except Exception:
            log.exception("decision log %s: write failed; %d item(s) lost", self.path, len(ops))
            for kind, _ in ops:
                self._drop(kind, "store_error")
            return
        self.written["decision"] += res.decisions
        self.written["outcome"] += res.outcomes
        self.metrics.written.labels(kind="decision").inc(res.decisions)
        self.metrics.written.labels(kind="outcome").inc(res.outcomes)
        for _ in range(res.orphan_outcomes):
            self._drop("outcome", "no_decision")

    # -- control ----------------------------------------------------------------------------
    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued so far is committed (tests, shutdown, the demo)."""
        if self._closed or not self._thread.is_alive():
            return False
        ev = threading.Event()
        self._q.append(ev)  # past the bound: a flush is not a record
        self._wake.set()
        return ev.wait(timeout)

    def get(self, decision_id: str) -> dict[str, Any] | None:
        """A committed record with its outcome (the admin API's decision-by-id)."""
        return self.store.get(decision_id)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, then close the log. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._q.append(_STOP)
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("decision log %s: writer stuck; closing with records queued", self.path)
        unregister_open(self.store)
        if not self._thread.is_alive():
            self.store.close()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NullRecorder:
    """The recorder when no decision log is configured: every call is a no-op."""

    path = None
    capture_prompts = False

    def decision(self, decision: Decision, pool: Pool | None = None, *,
                 prompt: str | None = None) -> bool:
        return False

    def outcome(self, decision_id: str, outcome: Outcome) -> bool:
        return False

    def flush(self, timeout: float = 10.0) -> bool:
        return True

    def get(self, decision_id: str) -> dict[str, Any] | None:
        return None

    def close(self, timeout: float = 10.0) -> None:
        return None

    def __enter__(self) -> NullRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def open_recorder(path: str | os.PathLike[str] | None, **kwargs: Any) -> Recorder | NullRecorder:
    """``--decision-log PATH`` → a Recorder; no path → a NullRecorder."""
    return Recorder(path, **kwargs) if path else NullRecorder()
