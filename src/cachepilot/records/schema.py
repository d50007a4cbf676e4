"""The decision record: one versioned JSON object per routing decision, outcome joined later.

A record holds everything ``cachepilot explain`` shows and everything ``cachepilot replay``
needs to rebuild the router's inputs and call the same ``Router.decide``: every candidate
with the worker snapshot it was priced from (readiness, the scrape in force, requests in
flight, pending prefill, learned batch size, the worker's learned TTFT model) and its priced
terms in ms, the policy, weights, decision counter and tie key (the decision id), plus,
when the recorder was given the pool, the pool's cost model. (No live policy keeps state of
its own: what is learned, each worker's TTFT model, is in its candidate.)

Prompt text is never part of a record unless the caller passes ``capture_prompt``
(the recorder only does so when the operator enabled prompt capture). The prefix is
identified by its chained block hashes, 16 hex digits each (JSON-safe: 64-bit ints lose
precision in most JSON readers), since schema 3 written as one string
(:func:`record_hashes` reads every schema's).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cachepilot.core.decision import Candidate, Decision
from cachepilot.core.lifecycle import Outcome
from cachepilot.core.workers import TTFTParams, WorkerMetrics, WorkerSnapshot

# 2: candidates carry the worker state they were priced from (replay calls Router.decide);
# outcomes name their TTFT with ttft_kind. Logs of schema 1 can still be read and explained.
# 3: the hashes as one string, not a list of 16-digit strings: cutting the hex text into one
# string per block was ~0.3 of the writer's 0.4 ms per 220 KB prompt (3,520 blocks).
SCHEMA_VERSION = 3
READABLE_SCHEMAS = (1, 2, 3)

# Outcome fields the gateway or simulator may report, all optional.
OUTCOME_FIELDS: dict[str, type | tuple[type, ...]] = {
    "status": int,  # HTTP status the worker answered with (or the gateway's error status)
    "ttft_ms": (int, float),  # request sent → first token (or first byte, see ttft_kind)
    # "first_token": a real TTFT (a streamed response's first chunk, a simulated engine's
    # first token); "first_byte": a non-streamed body, so TTFT + the whole generation.
    "ttft_kind": str,
    "cached_tokens": int,  # usage.prompt_tokens_details.cached_tokens reported by the worker
    "prompt_tokens": int,  # usage.prompt_tokens
    "completion_tokens": int,
    "completed_at": (int, float),  # the caller's clock, like the decision's time
    "error": str,
    "aborted": bool,  # the client or the stream went away before the end
    "first_byte_ms": (int, float),  # request sent → response headers (streamed or not)
}
# Schema 1 named the TTFT's kind "first_byte": stream / sim / body.
_V1_TTFT_KIND = {"stream": "first_token", "sim": "first_token", "body": "first_byte"}

# A candidate's priced features and terms, then its worker snapshot flattened beside them
# (the snapshot's ``ttft`` stored as ``ttft_params``, as schema 2 has always named it).
CANDIDATE_FIELDS = tuple(f for f in Candidate.__dataclass_fields__ if f != "state")
SNAPSHOT_FIELDS = ("ready", "metrics", "inflight", "pending_requests",
                   "pending_prefill_tokens", "batch_cap_seen")
METRICS_FIELDS = tuple(WorkerMetrics.__dataclass_fields__)
PARAMS_FIELDS = tuple(TTFTParams.__dataclass_fields__)


def hash_hex(h: int) -> str:
    return f"{h & 0xFFFF_FFFF_FFFF_FFFF:016x}"


def hashes_hex(hashes: Sequence[int]) -> str:
    """Every hash as :func:`hash_hex` writes it, one after another in one string (numpy
    converts them in one pass)."""
    try:
        return np.array(hashes, dtype=">u8").tobytes().hex()
    except (OverflowError, TypeError, ValueError):  # negative or wider: the exact way
        return "".join(hash_hex(h) for h in hashes)


def record_hashes(record: Mapping[str, Any]) -> list[int]:
    """A record's block hashes as ints: one string of 16-digit groups (schema 3), or a list
    of 16-digit strings (schemas 1 and 2)."""
    hashes = record["hashes"]
    if isinstance(hashes, str):
        if len(hashes) % 16:
            raise ValueError(f"record {record.get('id')}: hashes are not 16-digit groups")
        return np.frombuffer(bytes.fromhex(hashes), dtype=">u8").tolist()
    return [hash_int(h) for h in hashes]


def hash_int(s: str) -> int:
    return int(s, 16)


def decision_to_record(decision: Decision, *, capture_prompt: str | None = None,
                       pool: Any = None, cost: Mapping[str, Any] | None = None,
                       source: str | None = None,
                       recorded_at: float | None = None) -> dict[str, Any]:
    """A Decision → a JSON-ready record. ``pool`` (or a pre-taken ``cost``) adds the pool's
    cost model; ``capture_prompt`` is stored only when given."""
    if pool is not None and cost is None:
        cost = pool.spec.cost.to_dict()
    cands = []
    for c in decision.candidates:
        d = {f: getattr(c, f) for f in CANDIDATE_FIELDS}
        s = c.state
        d.update({f: getattr(s, f) for f in SNAPSHOT_FIELDS})
        m, p = s.metrics, s.ttft
        d["metrics"] = None if m is None else {f: getattr(m, f) for f in METRICS_FIELDS}
        d["ttft_params"] = None if p is None else {f: getattr(p, f) for f in PARAMS_FIELDS}
        cands.append(d)
    winner = next((c for c in decision.candidates if c.worker == decision.chosen), None)
    rec: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "id": decision.id,
        "time": decision.time,
        "pool": decision.pool,
        "model": decision.model,
        "policy": decision.policy,
        "weights": dict(decision.weights),
        "seq": decision.seq,
        "tokens": decision.tokens,
        "blocks": len(decision.hashes),
        "block_size": decision.block_size,
        "hashes": hashes_hex(decision.hashes),
        "candidates": cands,
        "chosen": decision.chosen,
        "margin_ms": decision.margin_ms,
        "reason": decision.reason,
        "uncached_tokens": decision.uncached_tokens,
        "arrival_rate": decision.arrival_rate,
        "typical_uncached": decision.typical_uncached,
        "predicted_ttft_ms": winner.predicted_ttft_ms if winner else None,
        "predicted_hit": bool(winner and winner.matched_blocks > 0),
        "predicted_cached_tokens": winner.matched_tokens if winner else 0,
        # Why the request was matched approximately in a pool hashing as its engines do
        # (no chat template, multimodal, …); None: exactly, or the pool is approximate.
        "exact_fallback": decision.fallback,
        # How long this replica held it for its turn on a long prompt (core.spread), in ms.
        "turn_ms": decision.turn_ms,
    }
    if decision.flow is not None:  # flow control: tenant, band, time held and why
        rec["flow"] = decision.flow.to_dict()
    if cost is not None:
        rec["cost"] = dict(cost)
    if source is not None:
        rec["source"] = source
    if recorded_at is not None:
        rec["recorded_at"] = recorded_at
    if capture_prompt is not None:
        rec["prompt"] = capture_prompt
    return rec


# The Outcome fields a record stores (``observed`` is the driver's, not the request's).
_RECORDED = tuple(f for f in Outcome.__dataclass_fields__ if f not in ("observed", "answered_by"))


def outcome_fields(outcome: Outcome) -> dict[str, Any]:
    """An Outcome as the record's outcome fields: what it says (None fields dropped, since
    a later report may fill them in); who answered under ``extra``, as always."""
    out: dict[str, Any] = {}
    for name in _RECORDED:
        value = getattr(outcome, name)
        if value is not None:
            out[name] = value
    if outcome.answered_by is not None:
        out["extra"] = {"answered_by": outcome.answered_by}
    return out


def merge_outcome(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> dict[str, Any]:
    """Later reports add to earlier ones (first byte, then completion)."""
    merged = dict(old or {})
    for key, value in new.items():
        if key == "extra":
            merged["extra"] = {**merged.get("extra", {}), **value}
        else:
            merged[key] = value
    return merged


def join(record: dict[str, Any], outcome: Mapping[str, Any] | None) -> dict[str, Any]:
    """The record with its outcome and the derived comparisons: measured hit and TTFT error."""
    rec = dict(record)
    if outcome:
        out = dict(outcome)
        legacy = out.pop("first_byte", None)  # schema 1
        if legacy is not None and "ttft_kind" not in out:
            out["ttft_kind"] = _V1_TTFT_KIND.get(legacy, legacy)
        cached = out.get("cached_tokens")
        if cached is not None:
            out["measured_hit"] = cached > 0
            out["hit_predicted_right"] = out["measured_hit"] == rec.get("predicted_hit")
        ttft = out.get("ttft_ms")
        if ttft is not None and rec.get("predicted_ttft_ms") is not None:
            out["ttft_error_ms"] = ttft - rec["predicted_ttft_ms"]
        rec["outcome"] = out
    else:
        rec["outcome"] = None
    return rec


def record_to_candidates(record: Mapping[str, Any]) -> list[Candidate]:
    """Rebuild the Candidate objects a record was made from (unknown keys ignored)."""
    out = []
    for d in record["candidates"]:
        m, p = d.get("metrics"), d.get("ttft_params")
        state = WorkerSnapshot(
            address=d["worker"], ready=d.get("ready", True),
            metrics=None if m is None else WorkerMetrics(
                **{f: m[f] for f in METRICS_FIELDS if f in m}),
            inflight=d.get("inflight", 0), pending_requests=d.get("pending_requests", 0),
            pending_prefill_tokens=d.get("pending_prefill_tokens", 0),
            batch_cap_seen=d.get("batch_cap_seen", 0),
            ttft=None if p is None else TTFTParams(**{f: p[f] for f in PARAMS_FIELDS if f in p}))
        out.append(Candidate(state=state, **{f: d[f] for f in CANDIDATE_FIELDS if f in d}))
    return out


def check_record(record: Mapping[str, Any]) -> None:
    """Raise ValueError unless this is a complete record of a schema this code reads."""
    version = record.get("schema_version")
    if version not in READABLE_SCHEMAS:
        raise ValueError(f"decision record schema {version!r}; this cachepilot reads "
                         f"{', '.join(map(str, READABLE_SCHEMAS))}")
    for key in ("id", "time", "policy", "candidates", "chosen", "seq"):
        if key not in record:
            raise ValueError(f"decision record lacks {key!r}")
