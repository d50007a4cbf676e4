"""Flow control's state and bookkeeping: the pools' queues and their settings, who hears of
what happens, how requests leave the queue, and the counters' corrections.

:class:`~cachepilot.core.flow.control.FlowControl` adds admission and dispatch on top; the
split keeps each part readable (state here, decisions there).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from typing import Any

from cachepilot.core.decision import Decision
from cachepilot.core.flow.classify import FlowMeta
from cachepilot.core.flow.config import FlowConfig
from cachepilot.core.flow.fair import OutputEstimate
from cachepilot.core.flow.gate import Gate
from cachepilot.core.flow.info import FlowInfo
from cachepilot.core.flow.observe import FlowObserver, FlowPlugin
from cachepilot.core.flow.pick import Picker, make_picker
from cachepilot.core.flow.queue import CANCELLED, QUEUED, REFUSED, PoolQueue, Ticket
from cachepilot.core.flow.refusal import FlowError, refusal
from cachepilot.core.pool import Pool
from cachepilot.core.request import InferenceRequest
from cachepilot.core.router import Router


class FlowState:
    """One router's held requests (a queue per pool), its settings and its observers."""

    def __init__(self, router: Router, config: FlowConfig | None = None, *,
                 gate: Gate | None = None, picker: Picker | None = None,
                 observers: Sequence[FlowObserver] = ()) -> None:
        self.router = router
        # The gateway's settings; a pool's spec.flow replaces them for that pool.
        self.config = cfg = config or FlowConfig()
        self._gate, self._picker = gate, picker  # another scheduler's model: every pool's
        self._parts: dict[int, tuple[Gate, Picker]] = {}  # by id of a pool's FlowConfig
        self.observers: list[FlowObserver] = list(observers)
        self.queues: dict[str, PoolQueue] = {}
        self.objectives: dict[str, int] = {}  # InferenceObjective name → priority
        self.estimates = OutputEstimate(cfg.default_output_tokens)
        # Charge output at dispatch (an estimate, corrected at completion; a gateway sees no
        # tokens as they come) or as generated (the simulator's VTC model, charge_output).
        self.output_at_dispatch = True
        self.kick: Callable[[], None] = lambda: None  # the driver's "pump soon"
        # Dispatches an arrival may trigger when others are held (0: as many as can go;
        # a model of a scheduler that runs one dispatch cycle per arrival sets 1).
        self.arrival_limit = 0
        # A tenant backlogged in an idle band starts at the band's virtual time (off: VTC's
        # lift, to backlogged tenants only; cachepilot.core.flow.queue.PoolQueue).
        self.lift_to_virtual = True
        self.plugin = FlowPlugin(self)  # type: ignore[arg-type]
        self._seq = 0

    # -- leaving the queue ----------------------------------------------------------------------
    def cancel(self, t: Ticket, now: float) -> None:
        """``t``'s client left: out of the queue at once (nobody is answered)."""
        q = self.queues.get(t.pool)
        if t.state != QUEUED or q is None:
            return
        q.remove(t)
        t.state = CANCELLED
        for o in self.observers:
            o.on_cancelled(t, now)
        self.kick()  # what it blocked (a band's head) may go now

    def _finish(self, q: PoolQueue, t: Ticket, state: str, now: float, *,
                decision: Decision | None = None, error: FlowError | None = None) -> None:
        t.state, t.decision, t.error = state, decision, error
        if error is not None:
            self.router.reject(error, t.request, now)
            for o in self.observers:
                o.on_refused(t.pool, t.meta, error, now - t.enqueued, now)
        if t.on_done is not None:
            t.on_done(t)

    def _refuse(self, q: PoolQueue, t: Ticket, reason: str, now: float) -> None:
        self._finish(q, t, REFUSED, now, error=self._error(q, t.meta, reason, now))

    def _report_new(self, q: PoolQueue, req: InferenceRequest, meta: FlowMeta,
                    err: FlowError, now: float) -> FlowError:
        """A refusal at arrival, reported; the caller raises it."""
        self.router.reject(err, req, now)
        for o in self.observers:
            o.on_refused(q.name, meta, err, 0.0, now)
        return err

    def _error(self, q: PoolQueue, meta: FlowMeta, reason: str, now: float) -> FlowError:
        return refusal(q, meta, reason, now, q.config)

    # -- bookkeeping ----------------------------------------------------------------------------
    def settle(self, pool: str, f: FlowInfo, completion_tokens: int, now: float) -> None:
        """A request finished: charge its tenant the real output instead of the estimate."""
        self.estimates.observe(f.tenant, completion_tokens)
        q = self.queues.get(pool)
        if q is not None and self.output_at_dispatch:
            delta = q.config.output_weight * (completion_tokens - f.estimated_output)
            q.counters.charge((f.priority, f.tenant), delta, now)

    def charge_output(self, pool: str, f: FlowInfo, tokens: int, now: float) -> None:
        """Charge output tokens as generated (a driver that sees them: the simulator)."""
        q = self.queues.get(pool)
        if q is not None:
            q.counters.charge((f.priority, f.tenant), q.config.output_weight * tokens, now)

    def next_deadline(self, now: float) -> float:
        """The driver's clock time, after ``now``, at which a held request expires or stops
        waiting for its prefix holder (inf: nothing will)."""
        return min((q.next_deadline(now) for q in self.queues.values() if q),
                   default=math.inf)

    @property
    def held(self) -> int:
        return sum(q.count for q in self.queues.values())

    def snapshot(self, now: float) -> list[dict[str, Any]]:
        """Per pool and band: held requests per tenant and the fairness lag (the spread of
        backlogged tenants' counters), for metrics and /flow."""
        out = []
        for q in self.queues.values():
            for p, band in q.bands.items():
                served = [q.counters.value((p, t), now) for t in band.tenants]
                out.append({"pool": q.name, "priority": p,
                            "tenants": {t: len(f) for t, f in band.tenants.items()},
                            "lag_tokens": max(served) - min(served) if served else 0.0,
                            "oldest_s": max((now - f[0].enqueued
                                             for f in band.tenants.values()), default=0.0)})
        return out

    def _queue(self, pool: Pool) -> PoolQueue:
        """The pool's queue, following its settings (the pool's own, or the gateway's)."""
        cfg = pool.spec.flow or self.config
        q = self.queues.get(pool.name)
        if q is None:
            q = self.queues[pool.name] = PoolQueue(pool.name, cfg)
            q.lift_to_virtual = self.lift_to_virtual
        elif q.config is not cfg:
            q.config = cfg
            q.counters.half_life_s = cfg.half_life_s
        return q

    def _gate_of(self, q: PoolQueue) -> Gate:
        return self._gate or self._parts_of(q.config)[0]

    def _picker_of(self, q: PoolQueue) -> Picker:
        return self._picker or self._parts_of(q.config)[1]

    def _parts_of(self, cfg: FlowConfig) -> tuple[Gate, Picker]:
        parts = self._parts.get(id(cfg))
        if parts is None:
            parts = self._parts[id(cfg)] = (Gate(cfg.hold_depth), make_picker(cfg))
        return parts

    def _cost(self, cfg: FlowConfig, prompt_tokens: int, est_output: int) -> float:
        out = cfg.output_weight * est_output if self.output_at_dispatch else 0.0
        return cfg.input_weight * max(1, prompt_tokens) + out

    @staticmethod
    def _any_ready(pool: Pool, only: Collection[str] | None) -> bool:
        return any(w.ready for a, w in pool.workers.items() if only is None or a in only)
