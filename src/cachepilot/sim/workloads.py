"""Seeded, reproducible workloads: arrival times, prompts built from token segments, output
lengths.

A prompt is a list of *segments* ``(key, length)``. A segment's tokens are a pure function
of its key (a seeded draw from a 32k vocabulary), so two requests that start with the same
segments share a token prefix and therefore the same chained block hashes, exactly as two
chat requests with the same system prompt and document would. Segments also make traces
compact: a JSONL trace line may list segments instead of token ids.

Kinds (all parameters in :class:`WorkloadSpec`, defaults documented in docs/simulator.md):

- ``shared_prefix``: many groups, each a long document/system prompt, with short unique
  suffixes (RAG or agent templates). Group popularity uniform.
- ``hotspot``: one system prompt shared by every request, then one of a few documents chosen
  Zipf-like (a few very popular), then a short unique question.
- ``bursty``: the ``shared_prefix`` content with on/off (two-state Markov-modulated Poisson)
  arrivals of the same mean rate.
- ``sessions``: multi-turn chats; each turn's prompt is the whole conversation so far
  (system prompt, previous user turns and assistant answers), so a session grows its own
  prefix. Open loop: a turn arrives a think time after the previous one.
- ``trace``: a trace file replayed: CachePilot's JSONL (:func:`write_trace`) or Mooncake's
  (:mod:`cachepilot.sim.traces`), sped up and sampled by prefix group on request.

Drivers that send real HTTP requests (the load generator, the real-model experiment) turn a
request's segments into text with :func:`~cachepilot.sim.prompt_text.segment_text` /
:func:`~cachepilot.sim.prompt_text.chat_messages` (:mod:`cachepilot.sim.prompt_text`, its
names importable from here too): each segment's words are a pure function of its key too, so
the same sharing holds in text.

(A little over 400 lines: every workload kind and its trace form live together, because
they share the segment → tokens → hashes contract.)
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
from xxhash import xxh3_64_intdigest

from cachepilot.core.fingerprint import BlockConfig, Fingerprint, fingerprint
from cachepilot.sim.prompt_text import WORDS as WORDS  # re-exported
from cachepilot.sim.prompt_text import chat_messages as chat_messages  # re-exported
from cachepilot.sim.prompt_text import segment_text as segment_text  # re-exported
from cachepilot.sim.prompt_text import words as words  # re-exported
from cachepilot.sim.traces import detect_format, read_mooncake

VOCAB = 32000
MODEL = "sim-model"
BLOCK = BlockConfig(block_size=16)

Segment = tuple[str, int]


@dataclass(frozen=True, slots=True)
class Dist:
    """A length distribution: lognormal with ``median`` and ``sigma``, clipped to
    [lo, hi]; ``sigma`` 0 gives the constant ``median``; ``kind='uniform'`` draws in [lo, hi]."""

    median: float
    sigma: float = 0.0
    lo: int = 1
    hi: int = 1 << 30
    kind: str = "lognormal"

    def draw(self, rng: np.random.Generator, n: int | None = None) -> np.ndarray:
        size = 1 if n is None else n
        if self.kind == "uniform":
            x = rng.integers(self.lo, self.hi + 1, size=size).astype(float)
        elif self.sigma <= 0:
            x = np.full(size, float(self.median))
        else:
            x = self.median * np.exp(self.sigma * rng.standard_normal(size))
        return np.clip(np.rint(x), self.lo, self.hi).astype(np.int64)

    def one(self, rng: np.random.Generator) -> int:
        return int(self.draw(rng)[0])


# Output lengths of chat answers: median 128 tokens, long tail (mean ≈ 165).
OUTPUT = Dist(128, 0.7, 4, 1024)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    kind: str = "shared_prefix"
    rate: float = 20.0  # mean arrivals per second
    duration: float = 60.0  # seconds of arrivals
    output: Dist = OUTPUT
    # shared_prefix / bursty
    groups: int = 48
    prefix: Dist = Dist(2048, 0.3, 512, 4096)
    suffix: Dist = Dist(0, 0, 32, 256, kind="uniform")
    # hotspot
    system_tokens: int = 256
    docs: int = 16
    doc: Dist = Dist(1536, 0.2, 512, 3072)
    zipf_s: float = 1.5
    question: Dist = Dist(0, 0, 16, 128, kind="uniform")
    # bursty: two-state MMPP, (rate, mean sojourn s) for the high and the low state
    burst_high: tuple[float, float] = (50.0, 2.0)
    burst_low: tuple[float, float] = (5.0, 4.0)
    # sessions
    system_prompts: int = 4
    turns: Dist = Dist(5, 0.5, 1, 20)
    user_turn: Dist = Dist(0, 0, 32, 256, kind="uniform")
    think_s: float = 8.0
    # shared_prefix: share of requests whose document is their own (nothing else shares it)
    p_unique: float = 0.0
    # shared_prefix / bursty: requests that arrive at the same instant at each arrival (a
    # client's fan-out; a trace whose timestamps group requests, as Mooncake's can)
    together: Dist = Dist(1)
    # trace: a file in CachePilot's JSONL format or Mooncake's (detected), its arrivals
    # sped up ``rate_scale`` times; with ``sample`` < 1, each seed keeps that share of the
    # trace's prefix groups (requests whose first block is the same: a conversation or a
    # shared document), drawn by the seed: independent samples of one trace that keep its
    # reuse, for across-seed studies.
    path: str = ""
    rate_scale: float = 1.0
    sample: float = 1.0

    def to_dict(self) -> dict:
        return asdict(self)

    def with_(self, **changes) -> WorkloadSpec:
        return replace(self, **changes)


@dataclass(slots=True)
class SimRequest:
    """One request of a workload, with its prompt already fingerprinted."""

    id: int
    arrival: float
    segments: tuple[Segment, ...]
    max_tokens: int
    fp: Fingerprint
    # Token offset where the request's own (user) content starts, after shared system text;
    # KubeAI's CHWBL keys on the start of the user message.
    user_start: int = 0
    group: str = ""
    extra: dict = field(default_factory=dict)
    # KubeAI's key: the first 100 characters of the first user message (:func:`prefix_key`).
    prefix_key: int | None = None

    @property
    def prompt_tokens(self) -> int:
        return self.fp.tokens


@dataclass(slots=True)
class Workload:
    spec: WorkloadSpec
    seed: int
    requests: list[SimRequest]

    def __len__(self) -> int:
        return len(self.requests)

    def summary(self) -> dict[str, float]:
        reqs = self.requests
        if not reqs:
            return {"requests": 0}
        span = max(r.arrival for r in reqs) - min(r.arrival for r in reqs)
        seen: set[int] = set()
        repeated: set[int] = set()
        for r in reqs:
            for h in r.fp.hashes:
                if h in seen:
                    repeated.add(h)
                else:
                    seen.add(h)
        return {
            "requests": len(reqs),
            "rate": len(reqs) / span if span > 0 else float("nan"),
            "mean_prompt_tokens": float(np.mean([r.prompt_tokens for r in reqs])),
            "mean_output_tokens": float(np.mean([r.max_tokens for r in reqs])),
            "distinct_blocks": len(seen),
            "shared_blocks": len(repeated),  # blocks that occur in more than one request
            "total_blocks": sum(r.fp.blocks for r in reqs),
        }


class _Tokens:
    """Segment key → token ids, drawn from a seed derived from the key (stable across runs)."""

    def __init__(self) -> None:
        self._cache: dict[str, np.ndarray] = {}

    def get(self, key: str, length: int, keep: bool) -> np.ndarray:
        cached = self._cache.get(key)
        if cached is not None and len(cached) >= length:
            return cached[:length]
        seed = np.frombuffer(key.encode().ljust(8, b"\0"), dtype=np.uint8).astype(np.uint64)
        rng = np.random.default_rng(seed.tolist())
        toks = rng.integers(0, VOCAB, size=length, dtype=np.uint32)
        if keep:
            self._cache[key] = toks
        return toks

    def prompt(self, segments: Sequence[Segment], shared: int) -> np.ndarray:
        """Concatenate segments; the first ``shared`` are cached (they recur)."""
        parts = [self.get(k, n, i < shared) for i, (k, n) in enumerate(segments)]
        return np.concatenate(parts) if len(parts) > 1 else parts[0]


def _fp(tokens: np.ndarray) -> Fingerprint:
    return fingerprint(MODEL, BLOCK, token_ids=tokens)


# KubeAI's Prefix(): 100 characters, 25 tokens at the 4 characters a token of segment_text.
PREFIX_TOKENS = 25


def prefix_key(tokens: np.ndarray, segments: Sequence[Segment], user_start: int) -> int:
    """What KubeAI's ``Prefix(100)`` hashes, for a request of these ``segments``: the first
    100 characters of the first user message. A workload's user content starts at
    ``user_start`` (everything before it is shared system text) and its first user message
    is at least the segment that starts there (sessions: the first user turn; the others:
    the document), so the key is that segment's first 25 tokens, unchained: later turns,
    answers and the system prompt are not in it."""
    end = len(tokens)
    pos = 0
    for _, n in segments:
        if pos >= user_start:
            end = pos + n
            break
        pos += n
    return xxh3_64_intdigest(tokens[user_start:min(end, user_start + PREFIX_TOKENS)].tobytes())


def poisson_arrivals(rng: np.random.Generator, rate: float, duration: float) -> np.ndarray:
    n = rng.poisson(rate * duration)
    return np.sort(rng.uniform(0.0, duration, size=n))


def mmpp_arrivals(rng: np.random.Generator, high: tuple[float, float],
                  low: tuple[float, float], duration: float) -> np.ndarray:
    """Two-state Markov-modulated Poisson process, starting in the high state."""
    out: list[np.ndarray] = []
    t, state = 0.0, 0
    while t < duration:
        rate, mean_sojourn = (high, low)[state]
        end = min(duration, t + rng.exponential(mean_sojourn))
        n = rng.poisson(rate * (end - t))
        out.append(rng.uniform(t, end, size=n))
        t, state = end, 1 - state
    return np.sort(np.concatenate(out)) if out else np.zeros(0)


def zipf_weights(n: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** s
    return w / w.sum()


def generate(spec: WorkloadSpec, seed: int) -> Workload:
    """Draw a workload. The same (spec, seed) always gives the same requests and hashes."""
    rng = np.random.default_rng([seed, _KIND_IDS.get(spec.kind, 99)])
    if spec.kind in ("shared_prefix", "bursty"):
        reqs = _shared_prefix(spec, seed, rng)
    elif spec.kind == "hotspot":
        reqs = _hotspot(spec, seed, rng)
    elif spec.kind == "sessions":
        reqs = _sessions(spec, seed, rng)
    elif spec.kind == "trace":
        reqs = _trace(spec, seed)
    else:
        raise ValueError(f"unknown workload kind {spec.kind!r}; known: {sorted(_KIND_IDS)}")
    return Workload(spec, seed, reqs)


_KIND_IDS = {"shared_prefix": 1, "bursty": 2, "hotspot": 3, "sessions": 4, "trace": 5}


def _shared_prefix(spec: WorkloadSpec, seed: int, rng: np.random.Generator) -> list[SimRequest]:
    if spec.kind == "bursty":
        times = mmpp_arrivals(rng, spec.burst_high, spec.burst_low, spec.duration)
    else:
        times = poisson_arrivals(rng, spec.rate, spec.duration)
    if spec.together != Dist(1):  # its own generator: other workloads' draws stay the same
        rng_t = np.random.default_rng([seed, _KIND_IDS[spec.kind], 11])
        times = np.repeat(times, spec.together.draw(rng_t, len(times)))
    n = len(times)
    prefix_len = spec.prefix.draw(rng, spec.groups)
    group = rng.integers(0, spec.groups, size=n)
    suffix = spec.suffix.draw(rng, n)
    out_len = spec.output.draw(rng, n)
    toks = _Tokens()
    reqs = []
    for i in range(n):
        g = int(group[i])
        segs = ((f"s{seed}g{g}", int(prefix_len[g])), (f"s{seed}r{i}", int(suffix[i])))
        ids = toks.prompt(segs, 1)
        reqs.append(SimRequest(i, float(times[i]), segs, int(out_len[i]), _fp(ids),
                               user_start=0, group=f"g{g}", prefix_key=prefix_key(ids, segs, 0)))
    if spec.p_unique > 0:  # its own generator: the draws above stay what they were
        rng_u = np.random.default_rng([seed, _KIND_IDS[spec.kind], 7])
        unique = rng_u.random(n) < spec.p_unique
        lengths = spec.prefix.draw(rng_u, n)
        for i in np.flatnonzero(unique):
            r = reqs[i]
            segs = ((f"s{seed}u{i}", int(lengths[i])), r.segments[1])
            ids = toks.prompt(segs, 0)
            reqs[i] = SimRequest(r.id, r.arrival, segs, r.max_tokens, _fp(ids), user_start=0,
                                 group=f"u{i}", prefix_key=prefix_key(ids, segs, 0))
    return reqs


def _hotspot(spec: WorkloadSpec, seed: int, rng: np.random.Generator) -> list[SimRequest]:
    times = poisson_arrivals(rng, spec.rate, spec.duration)
    n = len(times)
    doc_len = spec.doc.draw(rng, spec.docs)
    doc = rng.choice(spec.docs, size=n, p=zipf_weights(spec.docs, spec.zipf_s))
    question = spec.question.draw(rng, n)
    out_len = spec.output.draw(rng, n)
    toks = _Tokens()
    reqs = []
    for i in range(n):
        d = int(doc[i])
        segs = ((f"s{seed}sys", spec.system_tokens), (f"s{seed}d{d}", int(doc_len[d])),
                (f"s{seed}q{i}", int(question[i])))
        ids = toks.prompt(segs, 2)
        reqs.append(SimRequest(i, float(times[i]), segs, int(out_len[i]), _fp(ids),
                               user_start=spec.system_tokens, group=f"d{d}",
                               prefix_key=prefix_key(ids, segs, spec.system_tokens)))
    return reqs


def _sessions(spec: WorkloadSpec, seed: int, rng: np.random.Generator) -> list[SimRequest]:
    mean_turns = float(np.mean(spec.turns.draw(rng, 2000)))
    starts = poisson_arrivals(rng, spec.rate / max(mean_turns, 1.0), spec.duration)
    toks = _Tokens()
    pending: list[tuple[float, tuple[Segment, ...], int, str, int]] = []
    for s, t0 in enumerate(starts):
        sysp = int(rng.integers(0, spec.system_prompts))
        segs: list[Segment] = [(f"s{seed}sys{sysp}", spec.system_tokens)]
        t = float(t0)
        for k in range(spec.turns.one(rng)):
            segs.append((f"s{seed}S{s}u{k}", spec.user_turn.one(rng)))
            out = spec.output.one(rng)
            pending.append((t, tuple(segs), out, f"S{s}", k))
            segs.append((f"s{seed}S{s}a{k}", out))  # the answer becomes history
            t += float(rng.exponential(spec.think_s))
    pending.sort(key=lambda p: p[0])
    reqs = []
    for i, (t, segs, out, sess, k) in enumerate(pending):
        ids = toks.prompt(segs, len(segs))
        reqs.append(SimRequest(i, t, segs, out, _fp(ids), user_start=spec.system_tokens,
                               group=sess, extra={"turn": k},
                               prefix_key=prefix_key(ids, segs, spec.system_tokens)))
    return reqs


# -- traces ------------------------------------------------------------------------------------

def _trace(spec: WorkloadSpec, seed: int) -> list[SimRequest]:
    if spec.rate_scale <= 0 or not 0 < spec.sample <= 1:
        raise ValueError("a trace needs rate_scale > 0 and 0 < sample ≤ 1")
    if detect_format(spec.path) == "mooncake":
        # No text: the first 512-token block's id fixes the first 100 characters, and the
        # first hash is a function of it alone.
        reqs = [SimRequest(i, row.arrival_s, (), row.max_tokens, row.fingerprint,
                           prefix_key=row.fingerprint.hashes[0] if row.fingerprint.hashes
                           else None)
                for i, row in enumerate(read_mooncake(spec.path, model=MODEL, block=BLOCK))]
    else:
        reqs = list(read_trace(spec.path))
    if not reqs:
        return []
    t0 = reqs[0].arrival
    for r in reqs:
        r.arrival = (r.arrival - t0) / spec.rate_scale
    if spec.sample < 1:
        salt = seed & 0xFFFF_FFFF_FFFF_FFFF
        keep = 2**64 * spec.sample

        def kept(r: SimRequest) -> bool:
            first = r.fp.hashes[0] if r.fp.hashes else r.id
            return xxh3_64_intdigest(first.to_bytes(8, "little"), salt) < keep

        reqs = [r for r in reqs if kept(r)]
        for i, r in enumerate(reqs):
            r.id = i
    return reqs


def write_trace(requests: Iterable[SimRequest], path: str | Path) -> None:
    """One JSON object per line: arrival time, segments, max_tokens, user_start, group."""
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps({"t": r.arrival, "segments": [list(s) for s in r.segments],
                                "max_tokens": r.max_tokens, "user_start": r.user_start,
                                "group": r.group}) + "\n")


def read_trace(path: str | Path) -> Iterable[SimRequest]:
    """Replay a JSONL trace. Each line has ``t`` (seconds) and ``max_tokens``, and either
    ``token_ids`` (a list of ints) or ``segments`` (a list of ``[key, length]``)."""
    toks = _Tokens()
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not JSON: {exc}") from None
    rows.sort(key=lambda d: float(d["t"]))
    for i, d in enumerate(rows):
        if "token_ids" in d:
            ids = np.asarray(d["token_ids"], dtype=np.uint32)
            segs: tuple[Segment, ...] = ()
        else:
            segs = tuple((str(k), int(n)) for k, n in d["segments"])
            ids = toks.prompt(segs, len(segs))
        start = int(d.get("user_start", 0))
        yield SimRequest(i, float(d["t"]), segs, int(d.get("max_tokens", 128)), _fp(ids),
                         user_start=start, group=str(d.get("group", "")),
                         prefix_key=prefix_key(ids, segs, start))
