"""A continuous-batching engine with a block prefix cache, modelled on vLLM V1's scheduler.

Pure state machine on the caller's clock: ``submit`` requests, ``step(now)`` runs one batch
and says how long it took and which requests produced their first token or finished. The
simulated worker server sleeps through each step in real time (scaled); the simulator jumps
its virtual clock.

Model, per step:
- Running sequences in decode each produce one token. The remaining token budget
  (``max_batched_tokens``) goes to prefill chunks, oldest first (chunked prefill).
- Waiting requests are admitted FCFS while the batch has a slot and the KV cache has room
  for their prompt *and* output blocks (reserved up front, so nothing is ever preempted).
- Step time = ``step_ms`` + ``decode_ms_per_seq`` × decoding sequences
  + ``prefill_ms_per_token`` × prefill tokens in the step.
- KV blocks hold ``block_size`` tokens. Full prompt blocks are registered under their chained
  hash when prefill completes; a freed block keeps its hash (a cache hit for later requests)
  until it is reused, oldest freed first; reusing one counts an eviction.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Defaults: a 7–8B model on one datacenter GPU (see cachepilot.core.cost)."""

    block_size: int = 16
    num_blocks: int = 8192  # 131k tokens of KV
    max_batch: int = 64
    max_batched_tokens: int = 4096
    prefill_ms_per_token: float = 0.08
    step_ms: float = 12.0
    decode_ms_per_seq: float = 0.1
    # 0: a paged engine with a shared block cache (vLLM). N > 0: N slots, each keeping one
    # prompt's KV in num_blocks / N blocks (llama.cpp; cachepilot.sim.slot_engine).
    slots: int = 0
    # Slot engines: prompts llama-server's host-memory prompt cache keeps (--cache-ram over
    # one prompt's state size); 0: --cache-ram 0, the slots only.
    prompt_cache: int = 0
    # Slot engines serving a sliding-window model (Gemma 3: 512 tokens): a match is reused
    # only up to a context checkpoint (cachepilot.core.slot_memory), which falls at the
    # batch starts (max_batched_tokens: llama-server's -ub) near a prompt's end. 0: none.
    sliding_window: int = 0


@dataclass(slots=True, eq=False)
class EngineRequest:
    id: Any
    prompt_tokens: int
    hashes: tuple[int, ...]  # chained hashes of the prompt's full blocks
    max_tokens: int
    arrival: float
    # Filled in by the engine.
    cached_tokens: int = 0
    computed: int = 0  # prompt tokens prefilled so far (cached ones count)
    output: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None
    _held: list[int] = field(default_factory=list)  # hashes this request pins
    _plain: int = 0  # blocks without a hash (unique tail, output)
    _new_from: int = 0  # index of the first block this request computes


@dataclass(slots=True)
class StepResult:
    start: float
    duration: float
    prefill_tokens: int = 0
    first_tokens: list[EngineRequest] = field(default_factory=list)
    finished: list[EngineRequest] = field(default_factory=list)
    decoded: list[EngineRequest] = field(default_factory=list)  # got a token this step

    @property
    def end(self) -> float:
        return self.start + self.duration


@dataclass(slots=True)
class EngineStats:
    waiting: int
    running: int
    kv_usage: float
    prefix_queries: int
    prefix_hits: int
    evictions: int
    completed: int
    busy_time: float


class Engine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.cfg = config or EngineConfig()
        self.waiting: deque[EngineRequest] = deque()
        self.prefilling: list[EngineRequest] = []
        self.decoding: set[EngineRequest] = set()
        self._done_heap: list[tuple[int, int, EngineRequest]] = []  # (finish step, tiebreak)
        self._step_no = 0
        self._tiebreak = 0
        self._chunks: list[tuple[EngineRequest, int]] = []  # the last step's prefill
        # KV blocks: empty free blocks, hashed blocks in use (refcount), hashed free (LRU).
        self._free_empty = self.cfg.num_blocks
        self._in_use: dict[int, int] = {}
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.evictions = 0
        self.completed = 0
        self.busy_time = 0.0

    # -- queries ------------------------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding)

    def free_blocks(self) -> int:
        return self._free_empty + len(self._free_cached)

    def kv_usage(self) -> float:
        return 1.0 - self.free_blocks() / self.cfg.num_blocks

    def stats(self) -> EngineStats:
        return EngineStats(len(self.waiting), self.running, self.kv_usage(), self.prefix_queries,
                           self.prefix_hits, self.evictions, self.completed, self.busy_time)

    def prefill_done_tokens(self, in_step: bool = False) -> int:
        """Prompt tokens computed so far of the requests still prefilling (cache hits
        not counted): what llama-server's /slots show, or vLLM's KV events as a chunked
        prefill stores its blocks. ``in_step``: the last step is still running, so its
        chunks are not done yet (a step's chunks are counted when it starts)."""
        done = sum(r.computed - r.cached_tokens for r in self.prefilling)
        if in_step:
            done -= sum(take for r, take in self._chunks if r.first_token_at is None)
        return max(0, done)

    def cached_prefix_blocks(self, hashes: tuple[int, ...]) -> int:
        n = 0
        for h in hashes:
            if h not in self._in_use and h not in self._free_cached:
                break
            n += 1
        return n

    # -- requests -----------------------------------------------------------------------------
    def submit(self, req: EngineRequest) -> None:
        need = -(-(req.prompt_tokens + req.max_tokens) // self.cfg.block_size)
        if need > self.cfg.num_blocks:
            raise ValueError(f"request needs {need} KV blocks; the engine has "
                             f"{self.cfg.num_blocks}")
        self.waiting.append(req)

    def step(self, now: float) -> StepResult:
        """Schedule and run one batch starting at ``now``; the result applies at its end."""
        cfg = self.cfg
        budget = cfg.max_batched_tokens - len(self.decoding)
        n_decode = len(self.decoding)
        chunks: list[tuple[EngineRequest, int]] = []
        for req in self.prefilling:
            if budget <= 0:
                break
            take = min(req.prompt_tokens - req.computed, budget)
            chunks.append((req, take))
            budget -= take
        while (self.waiting and budget > 0
               and len(self.prefilling) + len(self.decoding) < cfg.max_batch):
            req = self.waiting[0]
            if not self._admit(req):
                break
            self.waiting.popleft()
            self.prefilling.append(req)
            take = min(req.prompt_tokens - req.computed, budget)
            chunks.append((req, take))
            budget -= take
        prefill_tokens = sum(t for _, t in chunks)
        self._chunks = chunks
        duration = (cfg.step_ms + cfg.decode_ms_per_seq * n_decode
                    + cfg.prefill_ms_per_token * prefill_tokens) / 1000.0
        result = StepResult(start=now, duration=duration, prefill_tokens=prefill_tokens)
        if not chunks and not n_decode:
            result.duration = 0.0
            return result
        end = now + duration
        self.busy_time += duration
        self._step_no += 1
        result.decoded = list(self.decoding)
        for req in result.decoded:
            req.output += 1
        while self._done_heap and self._done_heap[0][0] <= self._step_no:
            _, _, req = heapq.heappop(self._done_heap)
            self._finish(req, end, result)
        for req, take in chunks:
            req.computed += take
            if req.computed >= req.prompt_tokens:
                self._prefilled(req, end, result)
        if result.first_tokens:
            done = set(map(id, result.first_tokens))
            self.prefilling = [r for r in self.prefilling if id(r) not in done]
        return result

    # -- internals ----------------------------------------------------------------------------
    def _admit(self, req: EngineRequest) -> bool:
        """Reserve KV for the whole request, reusing its cached prefix; False if it cannot fit."""
        bs = self.cfg.block_size
        total = -(-(req.prompt_tokens + req.max_tokens) // bs)
        hit = self.cached_prefix_blocks(req.hashes)
        if hit * bs >= req.prompt_tokens:  # one token must be computed to produce logits
            hit = max(0, -(-req.prompt_tokens // bs) - 1)
        pinned_free = sum(1 for h in req.hashes[:hit] if h in self._free_cached)
        new = total - hit
        if self.free_blocks() - pinned_free < new:
            return False
        for h in req.hashes[:hit]:
            if h in self._free_cached:
                del self._free_cached[h]
                self._in_use[h] = 1
            else:
                self._in_use[h] += 1
        take_empty = min(new, self._free_empty)
        self._free_empty -= take_empty
        for _ in range(new - take_empty):  # reuse the least recently freed cached blocks
            self._free_cached.popitem(last=False)
            self.evictions += 1
        req._held = list(req.hashes[:hit])
        req._plain = new
        req._new_from = hit
        req.cached_tokens = hit * bs
        req.computed = req.cached_tokens
        self.prefix_queries += req.prompt_tokens
        self.prefix_hits += req.cached_tokens
        return True

    def _prefilled(self, req: EngineRequest, end: float, result: StepResult) -> None:
        """Prefill done: register the prompt's computed full blocks; first token is out."""
        self._store_prefix(req)
        req.first_token_at = end
        req.output = 1
        result.first_tokens.append(req)
        if req.max_tokens <= 1:
            self._finish(req, end, result)
            return
        self.decoding.add(req)
        self._tiebreak += 1
        heapq.heappush(self._done_heap,
                       (self._step_no + req.max_tokens - 1, self._tiebreak, req))

    def _store_prefix(self, req: EngineRequest) -> None:
        for h in req.hashes[req._new_from:]:
            if h in self._in_use or h in self._free_cached:
                continue  # computed concurrently by another request; ours stays plain
            self._in_use[h] = 1
            req._held.append(h)
            req._plain -= 1

    def _finish(self, req: EngineRequest, end: float, result: StepResult) -> None:
        self.decoding.discard(req)
        req.finished_at = end
        self.completed += 1
        result.finished.append(req)
        self._release(req, end)

    def _release(self, req: EngineRequest, end: float) -> None:
        self._free_empty += req._plain
        req._plain = 0
        # Leaf first, so a shared root is the last of this chain to be reused.
        for h in reversed(req._held):
            n = self._in_use[h] - 1
            if n:
                self._in_use[h] = n
            else:
                del self._in_use[h]
                self._free_cached[h] = None
        req._held = []
