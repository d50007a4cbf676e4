"""Peer routing policies, modelled on what each project ships, for the simulator's studies.
:data:`SIM_POLICIES` is what the simulator can run: the live policies and these.

A peer is a core :class:`Policy`: it values the candidates (per-worker matched blocks, scraped
load, router in-flight counts) with the request's fingerprint in its context, and peers that
keep state of their own (SGLang's radix tree, Dynamo's active-block counts) update it in the
typed lifecycle hooks (``on_routed``, ``on_finish``) that the router calls. They are not in
:data:`~cachepilot.core.policies.LIVE_POLICIES`: a live pool cannot select them (they model
another router, and some need what only the simulator knows, such as where user content
starts).
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from xxhash import xxh3_64_intdigest

from cachepilot.core.decision import Candidate, Decision
from cachepilot.core.lifecycle import Outcome
from cachepilot.core.policies import LIVE_POLICIES, Context, Policy, Priced


class SGLangCacheAware(Policy):
    """SGLang router's ``cache_aware`` policy (sgl-project/sglang, sgl-router
    ``src/policies/cache_aware.rs``; defaults from ``RouterConfig``/``launch_router``:
    ``cache_threshold=0.3``, ``balance_abs_threshold=64``, ``balance_rel_threshold=1.5``).

    Load is the router's own count of in-flight requests per worker. The system is
    *imbalanced* when ``max - min > balance_abs_threshold`` and ``max > balance_rel_threshold
    * min``; then the least-loaded worker wins. Otherwise the request goes to the worker whose
    approximate radix tree matches the longest prefix if the match rate (matched / request
    length) exceeds ``cache_threshold``, else to the worker with the smallest tree. The tree
    records every prompt routed to a worker and is only trimmed by size (``max_tree_size``
    ≈ 67M characters, never reached here), so unlike CachePilot's directory it does not
    follow engine evictions. Modelled at block granularity (16 tokens) instead of characters.
    """

    name = "sglang_cache_aware"

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self._trees: dict[str, set[int]] = {}
        self._tree_tokens: dict[str, int] = {}

    def _matched(self, worker: str, hashes: Sequence[int]) -> int:
        tree = self._trees.get(worker, ())
        n = 0
        for h in hashes:
            if h not in tree:
                break
            n += 1
        return n

    def on_routed(self, decision: Decision, pool: Any) -> None:
        tree = self._trees.setdefault(decision.chosen, set())
        new = [h for h in decision.hashes if h not in tree]
        tree.update(new)
        self._tree_tokens[decision.chosen] = (self._tree_tokens.get(decision.chosen, 0)
                                              + len(new) * decision.block_size)

    def values(self, cands: Sequence[Candidate], ctx: Context) -> list[float]:
        loads = [c.inflight for c in cands]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            return [1.0 if ld == lo else 0.0 for ld in loads]
        hashes = ctx.fingerprint.hashes if ctx.fingerprint is not None else ()
        blocks = max(len(hashes), 1)
        matched = [self._matched(c.worker, hashes) for c in cands]
        best = max(matched)
        if best / blocks > self.cache_threshold:
            return [1.0 if m == best else 0.0 for m in matched]
        sizes = [self._tree_tokens.get(c.worker, 0) for c in cands]
        smallest = min(sizes)
        return [1.0 if s == smallest else 0.0 for s in sizes]


class KubeAICHWBL(Policy):
    """KubeAI's ``PrefixHash`` load balancing: consistent hashing with bounded loads (CHWBL;
    Mirrokni, Thorup, Zadimoghaddam 2018), defaults from the KubeAI Model CRD:
    ``meanLoadFactor=125`` (%), ``replication=256``, ``prefixCharLength=100``.

    The key is the first 100 characters of the request's user content (≈25 tokens at 4
    characters per token); we take the chained hash of the block that ends at or before that
    point, which identifies everything up to it. The key is placed on a ring with 256 points
    per worker; walking clockwise, the first worker whose in-flight load is at most
    ``1.25 × (total in-flight + 1) / workers`` wins (``internal/loadbalancer/
    balance_chwbl.go``: the +1 simulates the new request in the mean only).
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
        ring = sorted((xxh3_64_intdigest(f"{w}#{i}".encode()), w)
                      for w in workers for i in range(self.replication))
        self._ring = ring
        self._points = [p for p, _ in ring]
        self._members = tuple(sorted(workers))

    def _key(self, ctx: Context) -> int:
        fp = ctx.fingerprint
        if fp is None or not fp.hashes:
            return xxh3_64_intdigest(str(ctx.tokens).encode())
        user_start = ctx.request.user_start if ctx.request is not None else 0
        end_block = int((user_start + self.prefix_tokens) // fp.block_size)
        return fp.hashes[max(0, min(end_block, len(fp.hashes)) - 1)]

    def values(self, cands: Sequence[Candidate], ctx: Context) -> list[float]:
        names = tuple(sorted(c.worker for c in cands))
        if names != self._members:
            self._build(names)
        load = {c.worker: c.inflight for c in cands}
        total = sum(load.values())
        bound = self.load_factor * (total + 1) / len(cands)
        start = bisect.bisect_left(self._points, self._key(ctx))
        chosen = None
        ring = self._ring
        for k in range(len(ring)):
            w = ring[(start + k) % len(ring)][1]
            if total == 0 or load[w] <= bound:
                chosen = w
                break
        if chosen is None:  # unreachable with a factor ≥ 1; upstream keeps the ring's owner
            chosen = ring[start % len(ring)][1]
        return [1.0 if c.worker == chosen else 0.0 for c in cands]


class PowerOfTwo(Policy):
    """Power of two choices (Mitzenmacher 2001), as in sglang-router's and vllm-router's
    ``power_of_two``: two distinct workers drawn at random, the less loaded wins. Load here
    is the router's in-flight count (sglang-router refreshes engine-reported loads every
    5 s and falls back to its own counts). Draws are seeded by the decision counter, so runs
    are reproducible."""

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
    ``lib/llm/src/kv_router/scheduler.rs`` and ``sequence.rs``; docs/router/kv_cache_routing.md
    "Cost Calculation"; ``KvRouterConfig::default``: ``overlap_score_weight=1.0``,
    ``router_temperature=0``, output blocks not tracked)::

        prefill_tokens = (isl − overlap × B) + active prefill tokens of the worker
        decode_blocks  = |distinct blocks of its in-flight requests ∪ this request's blocks|
        cost = overlap_score_weight × prefill_tokens / B + decode_blocks     (lowest wins)

    Active prefill tokens are the uncached tokens of requests routed there whose first token
    has not come back (the core's pending prefill, as priced); in-flight blocks are
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
    """Gateway API Inference Extension endpoint picker, default scheduling profile
    (kubernetes-sigs/gateway-api-inference-extension, default ``EndpointPickerConfig``):
    ``queue-scorer`` weight 2, ``kv-cache-utilization-scorer`` weight 2,
    ``prefix-cache-scorer`` weight 3, ``max-score-picker``.

    queue: ``(max_q - q) / (max_q - min_q)`` over the candidates' scraped waiting queues
    (1 when all equal); kv: ``1 - kv_usage``; prefix: matched blocks / request blocks over
    the first ``max_prefix_blocks`` = 256 blocks of 16 tokens (64 characters) only, as the
    approximate prefix plugin truncates its input (``maxPrefixBlocksToMatch``). GIE keeps its
    own LRU index per server, filled on routing decisions like the core directory used here.
    Sources and versions: docs/research/peer-models.md (weights 2/2/3 since v1.2)."""

    name = "gie_default"

    def __init__(self, queue_weight: float = 2.0, kv_weight: float = 2.0,
                 prefix_weight: float = 3.0, max_prefix_blocks: int = 256) -> None:
        self.wq, self.wk, self.wp = queue_weight, kv_weight, prefix_weight
        self.max_blocks = max_prefix_blocks
        self._bs = 16

    def bind(self, pool) -> None:
        self._bs = pool.spec.block.block_size

    def values(self, cands: Sequence[Candidate], ctx: Context) -> list[float]:
        qs = [c.waiting for c in cands]
        hi, lo = max(qs), min(qs)
        blocks = min(self.max_blocks, max(1, -(-ctx.tokens // self._bs)))
        out = []
        for c in cands:
            q = 1.0 if hi == lo else (hi - c.waiting) / (hi - lo)
            kv = 1.0 - c.kv_usage
            prefix = min(1.0, min(c.matched_blocks, self.max_blocks) / blocks)
            out.append(self.wq * q + self.wk * kv + self.wp * prefix)
        return out


class PricedNoEviction(Priced):
    """An ablation, not a peer: the default policy without its eviction term (slot engines),
    to measure what that term buys."""

    name = "priced_no_eviction"

    def values(self, cands: Sequence[Candidate], ctx: Context) -> list[float]:
        return [v + c.eviction_ms for v, c in zip(super().values(cands, ctx), cands,
                                                   strict=True)]


PEERS = (SGLangCacheAware, KubeAICHWBL, PowerOfTwo, DynamoKV, GIEDefault)
PEER_POLICIES: Mapping[str, Callable[[], Policy]] = MappingProxyType({p.name: p for p in PEERS})
# What the simulator can run: every live policy, the peer models and the ablations.
SIM_POLICIES: Mapping[str, Callable[[], Policy]] = MappingProxyType(
    {**LIVE_POLICIES, **PEER_POLICIES, PricedNoEviction.name: PricedNoEviction})
