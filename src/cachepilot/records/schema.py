"""The decision record: one versioned JSON object per routing decision, outcome joined later.

A record holds everything ``cachepilot explain`` shows and everything ``cachepilot replay``
needs to re-decide without the live state: every candidate with its inputs (matched blocks,
queue, KV usage, metric age) and its priced terms in ms, the policy, weights and tie key
(the decision id), plus, when the recorder was given the pool, the cost model and each
worker's calibrated parameters so replay can re-price the terms under another cost model.

Prompt text is never part of a record unless the caller passes ``capture_prompt``
(the recorder only does so when the operator enabled prompt capture). The prefix is
identified by its chained block hashes, as 16-digit hex strings (JSON-safe: 64-bit ints
lose precision in most JSON readers).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cachepilot.core.decision import Candidate, Decision

SCHEMA_VERSION = 1

# Outcome fields the gateway or simulator may report, all optional.
OUTCOME_FIELDS: dict[str, type | tuple[type, ...]] = {
    "status": int,  # HTTP status the worker answered with (or the gateway's error status)
    "ttft_ms": (int, float),  # request sent → first response byte, measured
    "first_byte": str,  # what that first byte was: "stream" (first SSE chunk: a real TTFT),
    #                     "body" (a non-streamed body: TTFT + generation), "error", "sim"
    "cached_tokens": int,  # usage.prompt_tokens_details.cached_tokens reported by the worker
    "prompt_tokens": int,  # usage.prompt_tokens
    "completion_tokens": int,
    "completed_at": (int, float),  # the caller's clock, like the decision's time
    "error": str,
    "aborted": bool,  # the client or the stream went away before the end
    "first_byte_ms": (int, float),  # request sent → response headers (streamed or not)
    "ttft_kind": str,  # the gateway's name for it: "first_token" (streamed) or "first_byte"
}
# ttft_kind (the gateway's vocabulary) → first_byte kind, when first_byte is not given
_TTFT_KIND = {"first_token": "stream", "first_byte": "body"}

CANDIDATE_FIELDS = tuple(Candidate.__dataclass_fields__)


def hash_hex(h: int) -> str:
    return f"{h & 0xFFFF_FFFF_FFFF_FFFF:016x}"


def hash_int(s: str) -> int:
    return int(s, 16)


def worker_params(decision: Decision, pool: Any) -> dict[str, dict[str, Any]]:
    """Per-candidate parameters the priced terms used that the Decision does not carry:
    calibrated overrides (None: the pool's cost model applies) and the engine's KV block
    count. Taken from the live pool, so call it right after routing."""
    out: dict[str, dict[str, Any]] = {}
    workers = getattr(pool, "workers", {}) or {}
    for c in decision.candidates:
        w = workers.get(c.worker)
        if w is None:
            continue
        out[c.worker] = {
            "prefill_ms_per_token": w.prefill_ms_per_token,
            "queue_ms_per_waiting": w.queue_ms_per_waiting,
            "num_blocks": w.metrics.num_blocks if w.metrics is not None else None,
        }
    return out


def decision_to_record(decision: Decision, *, capture_prompt: str | None = None,
                       pool: Any = None, params: Mapping[str, Mapping[str, Any]] | None = None,
                       cost: Mapping[str, Any] | None = None, source: str | None = None,
                       recorded_at: float | None = None) -> dict[str, Any]:
    """A Decision → a JSON-ready record. ``pool`` (or pre-taken ``params`` and ``cost``)
    adds what re-pricing needs; ``capture_prompt`` is stored only when given."""
    if pool is not None:
        params = worker_params(decision, pool) if params is None else params
        cost = pool.spec.cost.to_dict() if cost is None else cost
    cands = []
    for c in decision.candidates:
        d = {f: getattr(c, f) for f in CANDIDATE_FIELDS}
        if params and c.worker in params:
            d["params"] = dict(params[c.worker])
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
        "hashes": [hash_hex(h) for h in decision.hashes],
        "candidates": cands,
        "chosen": decision.chosen,
        "margin_ms": decision.margin_ms,
        "reason": decision.reason,
        "uncached_tokens": decision.uncached_tokens,
        "predicted_ttft_ms": winner.predicted_ttft_ms if winner else None,
        "predicted_hit": bool(winner and winner.matched_blocks > 0),
        "predicted_cached_tokens": winner.matched_tokens if winner else 0,
        "extra": dict(decision.extra),
    }
    if cost is not None:
        rec["cost"] = dict(cost)
    if source is not None:
        rec["source"] = source
    if recorded_at is not None:
        rec["recorded_at"] = recorded_at
    if capture_prompt is not None:
        rec["prompt"] = capture_prompt
    return rec


def clean_outcome(fields: Mapping[str, Any]) -> dict[str, Any]:
    """Known outcome fields, type-checked; anything else goes under ``extra``. None values
    are dropped (a later report may fill them in)."""
    out: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in fields.items():
        if value is None:
            continue
        kind = OUTCOME_FIELDS.get(key)
        if kind is None:
            extra[key] = value
            continue
        if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
            raise TypeError(f"outcome field {key!r} must be {kind}, got {value!r}")
        out[key] = value
    if "ttft_kind" in out and "first_byte" not in out:
        out["first_byte"] = _TTFT_KIND.get(out["ttft_kind"], out["ttft_kind"])
    if extra:
        out["extra"] = extra
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
        out.append(Candidate(**{f: d[f] for f in CANDIDATE_FIELDS if f in d}))
    return out


def check_record(record: Mapping[str, Any]) -> None:
    """Raise ValueError unless this is a complete record of a schema this code reads."""
    version = record.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ValueError(f"decision record schema {version!r}; this cachepilot reads "
                         f"{SCHEMA_VERSION}")
    for key in ("id", "time", "policy", "candidates", "chosen", "seq"):
        if key not in record:
            raise ValueError(f"decision record lacks {key!r}")
