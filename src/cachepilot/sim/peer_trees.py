"""The two radix-tree routers among the peers, as the wheels the real-worker study runs
behave: sglang-router 0.3.2 and vllm-router 0.1.17, both with their ``cache_aware`` policy
and their CLI defaults (``cache_threshold=0.3``, ``balance_abs_threshold=64``,
``balance_rel_threshold=1.5``). docs/research/peer-models.md quotes the code and the live
probe (tests/sim/test_peer_routers_live.py) that checked these behaviours against the wheels.

Both count load as the router's own in-flight requests per worker and call the pool
*imbalanced* when ``max − min > 64`` and ``max > 1.5 × min`` (both strict). Both break ties
in load by taking the first worker in their registry order, fixed within a process and
arbitrary across processes; here, the pool's order. Both match at 16-token blocks where
upstream matches characters (SGLang) or tokens (vLLM): a partial block is never credited.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cachepilot.core.decision import Candidate, Decision
from cachepilot.core.policies import Context, Policy


def _first_least_loaded(loads: Sequence[int], among: Sequence[int] | None = None) -> int:
    """``min_by_key(load)`` over the workers in registry order: the first one with the least
    load (among ``among``, if given)."""
    idx = range(len(loads)) if among is None else among
    return min(idx, key=lambda i: loads[i])


def _one_hot(n: int, i: int) -> list[float]:
    return [1.0 if j == i else 0.0 for j in range(n)]


class _Thresholds(Policy):
    """The thresholds and the imbalance test both routers share."""

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold

    def imbalanced(self, loads: Sequence[int]) -> bool:
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo


class SGLangCacheAware(_Thresholds):
    """sglang-router 0.3.2 ``cache_aware`` (lightseekorg/smg, the sgl-model-gateway history,
    at ``c7f9bf9f5`` "[smg] release 0.3.2 (#17168)": ``src/policies/cache_aware.rs``
    ``select_worker`` L350-473, ``src/policies/tree.rs`` ``insert`` and
    ``prefix_match_with_counts``; the load guard in ``src/routers/http/router.rs`` L294)::

        if imbalanced:  w = first least-loaded worker
        else:
            matched, tenant = tree.prefix_match_with_counts(text)     # one tree, all workers
            if matched / len(text) > 0.3:  w = tenant
            else:                          w = first least-loaded worker   # since PR #14650
        tree.insert(text, w)

    A low match goes to the least-loaded worker, not to the smallest tree: upstream PR
    #14650 (2025-12-08) replaced ``get_smallest_tenant()`` with ``min_by_key(load)``, and
    every release from 0.2.4 has it (the probe confirmed it on the wheel). The tree is one
    for all workers; the tenant a match returns is the *creator* of the deepest node the
    text reaches (``last_tenant``: a leaf keeps its inserter, a split keeps the original
    node's), i.e. the first worker that was sent that text, not a random holder. At block
    granularity: the first worker routed a prompt containing the deepest matched block.
    The routing text is every message's content, assistant turns included (``protocols/
    chat.rs`` L641-695): our block hashes cover the whole prompt, so that holds here.
    The tree is trimmed only above ``max_tree_size`` = 2**26 characters per worker (~16M
    tokens), which no study reaches, so it never forgets what the engines evicted.
    """

    name = "sglang_cache_aware"

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5) -> None:
        super().__init__(cache_threshold, balance_abs_threshold, balance_rel_threshold)
        self._creator: dict[int, str] = {}  # block hash → the worker it was first sent to

    def on_routed(self, decision: Decision, pool: Any) -> None:
        setdefault = self._creator.setdefault
        for h in decision.hashes:
            setdefault(h, decision.chosen)

    def values(self, cands: Sequence[Candidate], ctx: Context) -> list[float]:
        n = len(cands)
        loads = [c.inflight for c in cands]
        if self.imbalanced(loads):
            return _one_hot(n, _first_least_loaded(loads))
        hashes = ctx.fingerprint.hashes if ctx.fingerprint is not None else ()
        bs = ctx.fingerprint.block_size if ctx.fingerprint is not None else 16
        depth = 0
        creator = self._creator
        for h in hashes:
            if h not in creator:
                break
            depth += 1
        if depth and depth * bs / max(1, ctx.tokens) > self.cache_threshold:
            owner = creator[hashes[depth - 1]]
            for i, c in enumerate(cands):
                if c.worker == owner:
                    return _one_hot(n, i)
            return _one_hot(n, 0)  # the tenant is gone or unhealthy: the first healthy worker
        return _one_hot(n, _first_least_loaded(loads))


class VLLMCacheAware(_Thresholds):
    """vllm-router 0.1.17 ``cache_aware`` in front of workers that tokenise as vLLM does
    (the PyPI sdist ``vllm_router-0.1.17``: ``src/policies/cache_aware.rs``
    ``select_worker_with_inputs`` L253, ``prepare_selection`` L266, ``select_prepared``
    L338-393; ``src/backend/preprocess.rs`` ``prepare_http_kv_inputs`` L179-290)::

        tokens_w = POST {w}/v1/completions/render, else POST {w}/tokenize   (every worker)
        rate_w   = tree.prefix_match_tenant(tokens_w, w) / len(tokens_w)    # per worker
        if not imbalanced and max rate > 0.3:  w = first least-loaded of those at the max
        else:                                  w = first least-loaded of all
        tree.insert(tokens_w, w)

    Unlike SGLang's, the match is per worker (its own paths only) and ties among the best
    matches go to the least loaded. The tree's budget (2**25 characters per worker, 8 per
    token: ~4M tokens) is not reached in the studies.
    """

    name = "vllm_cache_aware"

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5) -> None:
        super().__init__(cache_threshold, balance_abs_threshold, balance_rel_threshold)
        self._trees: dict[str, set[int]] = {}

    def on_routed(self, decision: Decision, pool: Any) -> None:
        self._trees.setdefault(decision.chosen, set()).update(decision.hashes)

    def _matched(self, worker: str, hashes: Sequence[int]) -> int:
        tree = self._trees.get(worker)
        if not tree:
            return 0
        n = 0
        for h in hashes:
            if h not in tree:
                break
            n += 1
        return n

    def values(self, cands: Sequence[Candidate], ctx: Context) -> list[float]:
        n = len(cands)
        loads = [c.inflight for c in cands]
        fp = ctx.fingerprint
        hashes = fp.hashes if fp is not None else ()
        bs = fp.block_size if fp is not None else 16
        rates = [self._matched(c.worker, hashes) * bs / max(1, ctx.tokens) for c in cands]
        best = max(rates)
        if not self.imbalanced(loads) and best > self.cache_threshold:
            return _one_hot(n, _first_least_loaded(loads, [i for i in range(n)
                                                           if rates[i] == best]))
        return _one_hot(n, _first_least_loaded(loads))


class VLLMCacheAwareUntokenized(Policy):
    """vllm-router 0.1.17 ``cache_aware`` in front of llama-server or the simulated worker:
    neither answers ``/v1/*/render``, llama-server's ``/tokenize`` wants ``content`` and
    returns no ``count``, the sim worker has none, so every worker "lacks tokens" and
    ``select_prepared`` (L355-359) takes its ``missing_tokens`` branch for every request:
    the first least-loaded worker by router in-flight count, the tree never updated. Join
    the shortest queue, with no prefix affinity at all (the probe saw a request whose
    prefix one worker held go to the other, less loaded one)."""

    name = "vllm_cache_aware_untokenized"

    def values(self, cands: Sequence[Candidate], ctx: Context) -> list[float]:
        return _one_hot(len(cands), _first_least_loaded([c.inflight for c in cands]))
