"""Routing policies: each turns the eligible candidates into values; the picker takes the
highest value and breaks ties by a per-decision hash, so equal workers share new prefixes
instead of all of them landing on the first one (herding)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from cachepilot.core.cost import Weights
from cachepilot.core.decision import Candidate, Decision
from cachepilot.core.fingerprint import Fingerprint
from cachepilot.core.lifecycle import Plugin
from cachepilot.core.request import InferenceRequest


@dataclass(frozen=True, slots=True)
class Context:
    """What a policy may look at besides the candidates."""

    seq: int  # the pool's decision counter (round robin's position)
    tokens: int
    weights: Weights
    fingerprint: Fingerprint | None = None  # the request's block hashes
    request: InferenceRequest | None = None  # None in a replay of a recorded decision


class Policy(Plugin):
    """Turns the eligible candidates into values (the highest wins). A policy is also a
    :class:`~cachepilot.core.lifecycle.Plugin` of its pool: policies that keep state of
    their own (learned weights, a peer router's tree) update it in the lifecycle hooks."""

    name: str = ""
    tie_tolerance: float = 0.0  # values this close to the best count as a tie

    def values(self, cands: Sequence[Candidate], ctx: Context) -> list[float]:
        raise NotImplementedError

    def bind(self, pool: Any) -> None:
        """Called once, when the policy is attached to a pool (to read its settings)."""

    def state(self) -> dict[str, float]:
        """Learned state this decision used, recorded with it (``Decision.extra``)."""
        return {}

    def restore(self, state: dict[str, Any]) -> None:
        """Set the learned state a recorded decision used, so replay decides as it did."""


class RoundRobin(Policy):
    """Each eligible worker in turn (by address), ignoring caches and load."""

    name = "round_robin"

    def values(self, cands: Sequence[Candidate], ctx: Context) -> list[float]:
        order = sorted(range(len(cands)), key=lambda i: cands[i].worker)
        n = len(cands)
        out = [0.0] * n
        for pos, i in enumerate(order):
            out[i] = -float((pos - ctx.seq) % n)
        return out


class LeastLoaded(Policy):
    """Fewest waiting + running requests, ignoring caches."""

    name = "least_loaded"

    def values(self, cands: Sequence[Candidate], ctx: Context) -> list[float]:
        return [-float(c.waiting + c.running) for c in cands]


class OverlapOnly(Policy):
    """Longest cached prefix alone: the policy that pins hot prefixes to one worker."""

    name = "overlap_only"

    def values(self, cands: Sequence[Candidate], ctx: Context) -> list[float]:
        return [float(c.matched_tokens) for c in cands]


class Priced(Policy):
    """CachePilot: prefill saved by the cache, minus queue wait and KV pressure, all in ms.
    With unit weights, the maximum is the worker with the lowest predicted TTFT."""

    name = "priced"
    tie_tolerance = 0.5

    def values(self, cands: Sequence[Candidate], ctx: Context) -> list[float]:
        w = ctx.weights
        return [w.prefill * c.saved_ms - w.load * c.queue_ms - w.kv * c.kv_ms for c in cands]


class AdaptivePriced(Policy):
    """CachePilot's priced policy with a load weight learned online, so it needs no tuning.

    The router predicts TTFT as ``base + prefill + queue + kv`` (ms). Each first token
    gives a measured TTFT; the part of it the queue term should explain is
    ``residual = ttft - base - prefill - kv`` of the chosen worker. The weight is the
    exponentially weighted least-squares slope of residual on the predicted queue term,
    ``w = Σ λ^k q·r / Σ λ^k q²`` (λ = ``decay`` per observation), clipped to
    [``w_min``, ``w_max``]: when queues cost more than the model says, the load penalty
    grows; when they cost less, locality gets more say. Decisions whose predicted queue is
    below ``min_queue_ms`` carry no information about the slope and are skipped.
    """

    name = "adaptive"
    tie_tolerance = 0.5

    def __init__(self, initial: float = 1.0, decay: float = 0.99, w_min: float = 0.05,
                 w_max: float = 16.0, min_queue_ms: float = 1.0, base_ms: float = 15.0) -> None:
        self.load_weight = initial
        self.decay = decay
        self.w_min, self.w_max = w_min, w_max
        self.min_queue_ms = min_queue_ms
        self.base_ms = base_ms
        self._sxy = 0.0
        self._sxx = 0.0
        self.updates = 0

    def bind(self, pool: Any) -> None:
        self.base_ms = pool.spec.cost.base_ttft_ms

    def state(self) -> dict[str, float]:
        return {"load_weight": self.load_weight}

    def restore(self, state: dict[str, Any]) -> None:
        lw = state.get("load_weight")
        if isinstance(lw, int | float):
            self.load_weight = float(lw)

    def values(self, cands: Sequence[Candidate], ctx: Context) -> list[float]:
        w = ctx.weights
        lw = self.load_weight
        return [w.prefill * c.saved_ms - lw * c.queue_ms - w.kv * c.kv_ms for c in cands]

    def on_first_token(self, decision: Decision, ttft_ms: float | None) -> None:
        if ttft_ms is None:
            return
        c = decision.winner
        q = c.queue_ms
        if q < self.min_queue_ms:
            return
        r = ttft_ms - self.base_ms - c.prefill_ms - c.kv_ms
        self._sxy = self.decay * self._sxy + q * r
        self._sxx = self.decay * self._sxx + q * q
        self.updates += 1
        if self._sxx > 0:
            w = self._sxy / self._sxx
            self.load_weight = min(self.w_max, max(self.w_min, w)) if math.isfinite(w) else 1.0


# The policies a live pool can run: the gateway drives every hook they have. The simulator's
# peer models (cachepilot.sim.peers) are a separate registry and never valid for a live pool.
LIVE_POLICIES: Mapping[str, Callable[[], Policy]] = MappingProxyType({
    p.name: p for p in (RoundRobin, LeastLoaded, OverlapOnly, Priced, AdaptivePriced)
})


def make_policy(name: str, registry: Mapping[str, Callable[[], Policy]] = LIVE_POLICIES) -> Policy:
    """A fresh policy from ``registry`` (by default the live ones); ValueError names the
    choices."""
    try:
        return registry[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of: "
                         f"{', '.join(sorted(registry))}") from None


def pick(values: Sequence[float], tolerance: float, tie_key: int) -> tuple[int, float]:
    """Index of the best value (ties split by ``tie_key``) and its margin over the runner-up."""
    best = max(values)
    tied = [i for i, v in enumerate(values) if v >= best - tolerance]
    choice = tied[tie_key % len(tied)]
    others = [v for i, v in enumerate(values) if i != choice]
    margin = values[choice] - max(others) if others else 0.0
    return choice, margin
