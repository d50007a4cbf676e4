"""Peer routing policies, modelled on the versions the real-worker study runs, for the
simulator's studies. :data:`SIM_POLICIES` is what the simulator can run: the live policies
and these.

A peer is a core :class:`Policy`: it values the candidates (router in-flight counts, scraped
metrics, its own index of what it routed) with the request's fingerprint in its context, and
peers that keep state of their own (the radix trees, GIE's block index, Dynamo's active
blocks) update it in the typed lifecycle hooks (``on_routed``, ``on_finish``) the router
calls. They are not in :data:`~cachepilot.core.policies.LIVE_POLICIES`: a live pool cannot
select them (they model another router, and some need what only the simulator knows, such
as each request's first user message).

Which version, and where each behaviour is in its code: the class docstrings, and
docs/research/peer-models.md (quotes, the live probe of the router wheels).
"""

from __future__ import annotations

import bisect
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from xxhash import xxh3_64_intdigest, xxh64_intdigest

from cachepilot.core.decision import Candidate, Decision
from cachepilot.core.lifecycle import Outcome
from cachepilot.core.policies import LIVE_POLICIES, Context, Policy, Priced
from cachepilot.sim.peer_trees import SGLangCacheAware, VLLMCacheAware, VLLMCacheAwareUntokenized


class KubeAICHWBL(Policy):
    """KubeAI's ``PrefixHash`` load balancing: consistent hashing with bounded loads (CHWBL;
    Mirrokni, Thorup, Zadimoghaddam 2018), substratusai/kubeai at ``2f32ef49`` (2025-07-06,
    the newest release's code): ``internal/loadbalancer/balance_chwbl.go``, ``group.go`` L70,
    ``api/openai/v1/chat_completions.go`` ``Prefix`` L525-542, defaults from
    ``api/k8s/v1/model_types.go``: ``meanLoadFactor=125`` (%), ``replication=256``,
    ``prefixCharLength=100``.

    The key is ``adapter + Prefix(100)``: the first 100 characters of the *first user
    message* (chat) or of the prompt (completions), nothing before or after it. The
    simulator gives it as the request's ``prefix_key`` (:func:`cachepilot.sim.workloads.
    prefix_key`: the first 25 tokens, at 4 characters a token, from where user content
    starts, within the first user segment). The key is placed on a ring of
    ``xxhash64(name + str(i))`` for i < 256 per worker; walking clockwise, the first worker
    whose in-flight load is at most ``1.25 × (total in flight + 1) / workers`` wins (the
    +1 in the mean only, since kubeai #528).
    """

    name = "kubeai_chwbl"

    def __init__(self, mean_load_factor: float = 1.25, replication: int = 256,
                 prefix_chars: int = 100, chars_per_token: float = 4.0) -> None:
        self.load_factor = mean_load_factor
        self.replication = replication
        self.prefix_tokens = prefix_chars / chars_per_token
        self._ring: list[tuple[int, str]] = []
        self._points: list[int] = []
        self._members: tuple[str, ...] = ()

    def _build(self, workers: Sequence[str]) -> None:
        ring = sorted((xxh64_intdigest(f"{w}{i}".encode()), w)
                      for w in workers for i in range(self.replication))
        self._ring = ring
        self._points = [p for p, _ in ring]
        self._members = tuple(sorted(workers))

    def _key(self, ctx: Context) -> int:
        req = ctx.request
        if req is not None and req.prefix_key is not None:
            return req.prefix_key
        # A driver that does not know the first user message: the prompt's first block
        # (completions: the prompt's start is the key).
        fp = ctx.fingerprint
        if fp is None or not fp.hashes:
            return xxh3_64_intdigest(str(ctx.tokens).encode())
        return fp.hashes[0]

    def values(self, cands: Sequence[Candidate], ctx: Context) -> list[float]:
        names = tuple(sorted(c.worker for c in cands))
        if names != self._members:
            self._build(names)
        load = {c.worker: c.inflight for c in cands}
        total = sum(load.values())
        bound = self.load_factor * (total + 1) / len(cands)
        start = bisect.bisect_left(self._points, self._key(ctx))
        ring = self._ring
        chosen = ring[start % len(ring)][1]  # upstream's fallback: the ring's first owner
        for k in range(len(ring)):
            w = ring[(start + k) % len(ring)][1]
            if total == 0 or load[w] <= bound:
                chosen = w
                break
        return [1.0 if c.worker == chosen else 0.0 for c in cands]


class PowerOfTwo(Policy):
    """Power of two choices (Mitzenmacher 2001) as vllm-router 0.1.17's ``power_of_two``
    runs it (``src/policies/power_of_two.rs``): two distinct workers drawn at random, the
    one with fewer requests in flight wins (the first drawn on a tie). Load is the router's
    in-flight count: ``tracks_request_load()`` is true (L99-104), and ``/get_load``, which
    llama-server and vLLM do not serve, adds nothing when it fails. sglang-router 0.3.2's
    ``power_of_two`` tracks no load (router.rs L294) and polls only ``/get_load``, so on
    these workers it compares 0 with 0 and is uniform random: not this model. Draws are
    seeded by the decision counter, so runs are reproducible."""

    name = "power_of_two"

    def values(self, cands: Sequence[Candidate], ctx: Context) -> list[float]:
        n = len(cands)
        if n == 1:
            return [0.0]
        h = xxh3_64_intdigest(ctx.seq.to_bytes(8, "little"), 0x2C)
        a = h % n
        b = (a + 1 + (h >> 32) % (n - 1)) % n
        win = a if cands[a].inflight <= cands[b].inflight else b
        return [1.0 if i == win else 0.0 for i in range(n)]


class DynamoKV(Policy):
    """NVIDIA Dynamo's KV router with its defaults (ai-dynamo/dynamo
    ``lib/kv-router/src/scheduling/selector/default.rs`` at ``07a6c9ce`` and
    ``scheduling/config.rs`` at ``0243c51b``; the older ``lib/llm/src/kv_router/
    scheduler.rs`` gives the same cost with these defaults)::

        prefill_blocks = (isl − overlap × B + active prefill tokens of the worker) / B
        decode_blocks  = |distinct blocks of its in-flight requests ∪ this request's blocks|
        cost = prefill_load_scale × prefill_blocks + decode_blocks          (lowest wins)

    ``prefill_load_scale=1``, overlap credit 1, no decay, active-request weight 0,
    temperature 0; ties uniformly at random (``minimum_cost_index``; here by the decision's
    hash). Active prefill tokens are the uncached tokens of requests routed there whose first
    token has not come back (the core's pending prefill, as priced); in-flight blocks are
    reference-counted, so a prefix shared by many in-flight requests counts once. Overlap
    comes from the core directory (Dynamo reads engine KV events: it sees a new prefix only
    once prefilled, which ours sees at routing; see docs/research/peer-models.md)."""

    name = "dynamo_kv"

    def __init__(self, overlap_score_weight: float = 1.0) -> None:
        self.w = overlap_score_weight
        self._refs: dict[str, Counter[int]] = {}

    def on_routed(self, decision: Decision, pool: Any) -> None:
        self._refs.setdefault(decision.chosen, Counter()).update(decision.hashes)

    def on_finish(self, decision: Decision, outcome: Outcome) -> None:
        refs = self._refs.get(decision.chosen)
        if refs is None:
            return
        refs.subtract(decision.hashes)
        for h in decision.hashes:
            if refs[h] <= 0:
                del refs[h]

    def values(self, cands: Sequence[Candidate], ctx: Context) -> list[float]:
        fp = ctx.fingerprint
        hashes = fp.hashes if fp is not None else ()
        bs = fp.block_size if fp is not None else 16
        out = []
        for c in cands:
            refs = self._refs.get(c.worker, {})
            prefill_tokens = ctx.tokens - c.matched_blocks * bs + c.pending_prefill_tokens
            decode_blocks = len(refs) + sum(1 for h in hashes if h not in refs)
            out.append(-(self.w * prefill_tokens / bs + decode_blocks))
        return out


class GIEDefault(Policy):
    """Gateway API Inference Extension endpoint picker, default scheduling profile, v1.5.0
    (kubernetes-sigs/gateway-api-inference-extension ``df9f8909``, the last release with the
    EPP; it moved to llm-d/llm-d-router in June 2026): ``pkg/epp/config/loader/defaults.go``
    ``queue-scorer`` ×2, ``kv-cache-utilization-scorer`` ×2, ``prefix-cache-scorer`` ×3,
    ``max-score-picker`` (shuffled, then sorted: ties at random).

    * queue (``scorer/queuedepth/queue.go``): ``(max_q − q) / (max_q − min_q)``, 1 when all
      are equal, ``q`` the scraped ``vllm:num_requests_waiting`` *as scraped*: not what this
      router sent since, which only CachePilot adds.
    * kv (``kvcacheutilization``): ``1 − vllm:kv_cache_usage_perc`` as scraped.
    * prefix (``scorer/prefix``, producer ``dataproducer/approximateprefix``): matched /
      total blocks, where the input is cut into blocks of ``4 × block size`` bytes (≈ one
      16-token block at 4 characters a token), **only full blocks** are hashed, only the
      first 256, and a prompt shorter than one block scores 0 everywhere. The EPP keeps its
      own index, one LRU of block hashes per server of ``num_gpu_blocks`` entries (AutoTune;
      31,250 when the engine does not say), filled for the chosen server after each
      decision; a match walks the request's hashes and stops at the first one no server
      holds, crediting every holder of each.

    Its default engine config reads vLLM's metric names: in front of llama-server (slot
    engines here) it sees no queue and no KV usage and ranks by prefix alone. Its scrape
    runs every 50 ms (``pkg/epp/server/options.go``); the peers study gives it that.
    """

    name = "gie_default"
    DEFAULT_LRU_BLOCKS = 31_250

    def __init__(self, queue_weight: float = 2.0, kv_weight: float = 2.0,
                 prefix_weight: float = 3.0, max_prefix_blocks: int = 256) -> None:
        self.wq, self.wk, self.wp = queue_weight, kv_weight, prefix_weight
        self.max_blocks = max_prefix_blocks
        self._index: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}

    def on_routed(self, decision: Decision, pool: Any) -> None:
        w = decision.chosen
        lru = self._index.get(w)
        if lru is None:  # sized when first filled, as upstream's (indexer.go Add)
            m = decision.winner.state.metrics
            cap = (m.num_blocks if m is not None and m.num_blocks else self.DEFAULT_LRU_BLOCKS)
            lru = self._index[w] = OrderedDict()
            self._capacity[w] = cap
        cap = self._capacity[w]
        for h in decision.hashes[:self.max_blocks]:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > cap:
            lru.popitem(last=False)

    @staticmethod
    def _scraped(c: Candidate) -> tuple[int, float]:
        """(waiting, KV usage) as the EPP reads them: vLLM's names only."""
        m = c.state.metrics
        if m is None or m.slots is not None:  # no metrics, or llama-server's
            return 0, 0.0
        return m.waiting, m.kv_usage or 0.0

    def values(self, cands: Sequence[Candidate], ctx: Context) -> list[float]:
        scraped = [self._scraped(c) for c in cands]
        qs = [q for q, _ in scraped]
        hi, lo = max(qs), min(qs)
        fp = ctx.fingerprint
        hashes = fp.hashes[:self.max_blocks] if fp is not None else ()
        matched = [0] * len(cands)
        lrus = [self._index.get(c.worker, {}) for c in cands]
        for h in hashes:
            holders = [i for i, lru in enumerate(lrus) if h in lru]
            if not holders:
                break
            for i in holders:
                matched[i] += 1
        total = len(hashes)
        out = []
        for (q, kv), m in zip(scraped, matched, strict=True):
            queue = 1.0 if hi == lo else (hi - q) / (hi - lo)
            prefix = m / total if total else 0.0
            out.append(self.wq * queue + self.wk * (1.0 - kv) + self.wp * prefix)
        return out


class PricedNoEviction(Priced):
    """An ablation, not a peer: the default policy without its eviction term (slot engines),
    to measure what that term buys."""

    name = "priced_no_eviction"

    def values(self, cands: Sequence[Candidate], ctx: Context) -> list[float]:
        return [v + c.eviction_ms for v, c in zip(super().values(cands, ctx), cands,
                                                   strict=True)]


PEERS = (SGLangCacheAware, VLLMCacheAware, VLLMCacheAwareUntokenized, KubeAICHWBL,
         PowerOfTwo, DynamoKV, GIEDefault)
PEER_POLICIES: Mapping[str, Callable[[], Policy]] = MappingProxyType({p.name: p for p in PEERS})
# What the simulator can run: every live policy, the peer models and the ablations.
SIM_POLICIES: Mapping[str, Callable[[], Policy]] = MappingProxyType(
    {**LIVE_POLICIES, **PEER_POLICIES, PricedNoEviction.name: PricedNoEviction})

__all__ = ["PEERS", "PEER_POLICIES", "SIM_POLICIES", "DynamoKV", "GIEDefault", "KubeAICHWBL",
           "PowerOfTwo", "PricedNoEviction", "SGLangCacheAware", "VLLMCacheAware",
           "VLLMCacheAwareUntokenized"]
