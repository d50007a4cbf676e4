"""Routing policies: each turns the eligible candidates into values; the picker takes the
highest value and breaks ties by a per-decision hash, so equal workers share new prefixes
instead of all of them landing on the first one (herding)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from cachepilot.core.cost import Weights
from cachepilot.core.decision import Candidate
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
    """CachePilot's default: the worker with the lowest predicted TTFT for this request, plus
    the delay its prefill there adds to the requests that arrive after it.

    The predicted TTFT already holds every effect on this request in ms: the prefill a cached
    prefix saves (only uncached tokens are prefilled), the queue ahead, decode interference
    and KV pressure. The congestion term prices what a greedy choice leaves out: recomputing
    a prefix on an idle worker can be as fast for this request as waiting for its holder,
    but costs the pool a prefill, which every later arrival pays in a burst. On slot engines
    (llama.cpp) the eviction term prices what the placement overwrites: a slot holding the
    last copy of a prompt that later requests share costs them its prefill again. Weights
    scale the prefill, load and KV terms (1.0 everywhere: trust the ms)."""

    name = "priced"
    tie_tolerance = 0.5

    def values(self, cands: Sequence[Candidate], ctx: Context) -> list[float]:
        w = ctx.weights
        dp, dl, dk = w.prefill - 1.0, w.load - 1.0, w.kv - 1.0
        return [-(c.predicted_ttft_ms + dp * c.prefill_ms + dl * c.queue_ms + dk * c.kv_ms
                  + c.congestion_ms + c.eviction_ms) for c in cands]


# The policies a live pool can run: the gateway drives every hook they have. The simulator's
# peer models (cachepilot.sim.peers) are a separate registry and never valid for a live pool.
LIVE_POLICIES: Mapping[str, Callable[[], Policy]] = MappingProxyType({
    p.name: p for p in (RoundRobin, LeastLoaded, OverlapOnly, Priced)
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
