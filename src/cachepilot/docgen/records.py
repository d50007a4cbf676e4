"""The decision-record reference: the fields of one record, read from a record the schema's
own code writes (a decision routed by a real Router, its outcome joined), described by the
comments on the dataclasses it is made from (Candidate, WorkerMetrics, TTFTParams) and on
records.schema's OUTCOME_FIELDS."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cachepilot.core import BlockConfig, InferenceRequest, Weights, WorkerMetrics
from cachepilot.core.decision import Candidate
from cachepilot.core.lifecycle import FIRST_TOKEN, Outcome
from cachepilot.core.router import static_router
from cachepilot.core.workers import TTFTParams, WorkerSnapshot
from cachepilot.docgen.markdown import (
    code,
    dict_comments,
    field_comments,
    generated_note,
    prose,
    table,
)
from cachepilot.records import schema

PATH = "reference/decision-record.md"

# The record's own keys (decision_to_record). Every key a record has must be here
# (tests/docgen/test_docgen.py), so a new field cannot go undocumented.
TOP: dict[str, str] = {
    "schema_version": "The record's schema; this version reads the ones listed above.",
    "id": "The decision id, as in the `x-cachepilot-decision-id` header.",
    "time": "When it was decided, on the driver's clock (Unix seconds for the gateway, "
            "virtual seconds for the simulator).",
    "pool": "The pool that served the model.",
    "exact_fallback": "Why this request was fingerprinted approximately although its pool is "
                      "exact (e.g. images, a template it cannot render, an unknown adapter), or "
                      "null: its block hashes are the engine's own.",
    "turn_ms": "With replicas: how long this replica held the request for its turn on a "
               "long, uncached prompt before routing it (0: not held). The outcome's TTFT "
               "counts from routing; the client waited this much more.",
    "model": "The body's `model`.",
    "policy": "The policy that decided (`priced` by default).",
    "weights": "The pool's weights on the priced terms.",
    "seq": "The pool's decision counter (round robin's position).",
    "tokens": "Prompt tokens (counted by the tokenizer, or estimated from bytes).",
    "blocks": "Full blocks of the prompt: the length of `hashes`.",
    "block_size": "Tokens per block.",
    "hashes": "The prompt's chained block hashes, 16 hex digits each, one after another in "
              "one string (schemas 1 and 2: a list of them): the prefix without its text.",
    "candidates": "Every worker as the decision priced it (table below), eligible or not.",
    "chosen": "The chosen worker's address.",
    "margin_ms": "How much better the chosen worker's value was than the runner-up's.",
    "reason": "One sentence for `cachepilot explain`.",
    "uncached_tokens": "The chosen worker's uncached tokens: the prefill it was sent.",
    "arrival_rate": "The pool's recent requests per second (prices congestion).",
    "typical_uncached": "The prefill assumed for a waiting request someone else sent.",
    "predicted_ttft_ms": "The chosen worker's predicted time to first token.",
    "predicted_hit": "Whether any block was predicted cached on the chosen worker.",
    "predicted_cached_tokens": "The tokens predicted cached there.",
    "cost": "The pool's cost model (when the recorder was given the pool).",
    "source": "Who recorded it (`gateway`, `sim`; optional).",
    "recorded_at": "When the recorder took it (optional).",
    "prompt": "The prompt text: only with `--capture-prompts`.",
    "outcome": "How the request ended, joined later (table below); null until reported.",
}
# Keys join() derives when the log is read (not stored).
DERIVED: dict[str, str] = {
    "measured_hit": "`cached_tokens` > 0 (derived when read).",
    "hit_predicted_right": "`measured_hit` equals `predicted_hit` (derived when read).",
    "ttft_error_ms": "`ttft_ms` − `predicted_ttft_ms` (derived when read).",
    "extra": "Who answered (`answered_by`), when the proxy said.",
}
_SNAPSHOT_EXTRA = {"metrics": "The scrape in force (table below); null before the first.",
                   "ttft_params": "The worker's learned TTFT model in ms (table below); null: "
                                  "the pool's prior."}


def example() -> dict[str, Any]:
    """A record as the schema writes it and the store returns it: two workers, one routed
    request, its outcome joined."""
    router = static_router(["10.0.0.5:8000", "10.0.0.6:8000"], policy="priced",
                           weights=Weights(), models=("llama",), block=BlockConfig(),
                           capacity_blocks=4096, engine="vllm")
    pool = router.pools["default"]
    for addr in pool.workers:
        pool.update_metrics(addr, WorkerMetrics(waiting=0, running=2, kv_usage=0.3,
                                                scraped_at=99.5))
    d = router.route(InferenceRequest(model="llama", prompt="You are a helpful assistant. " * 40),
                     now=100.0, decision_id="5f3a9c1e-1")
    rec = schema.decision_to_record(d, pool=pool, source="gateway", recorded_at=100.001)
    out = schema.outcome_fields(Outcome(status=200, ttft_ms=41.0, ttft_kind=FIRST_TOKEN,
                                        cached_tokens=0, completed_at=100.9,
                                        answered_by=d.chosen))
    return schema.join(rec, out)


# Candidate and snapshot fields whose dataclass has no comment of their own.
_CANDIDATE = {
    "worker": "The worker's address (`host:port`).",
    "eligible": "Whether it could be chosen.",
    "matched_blocks": "Blocks of the prompt the directory predicts cached there.",
    "matched_tokens": "The same in tokens.",
    "waiting": "Requests waiting there (the scrape plus what this router sent since).",
    "running": "Requests running there (likewise).",
    "kv_usage": "KV-cache usage, 0–1 (1 when its metrics are missing or stale).",
    "metrics_age_ms": "Age of the scrape in force; null without one.",
    "saved_ms": "Priced term: the prefill the cached prefix saves.",
    "prefill_ms": "Priced term: the prefill of the uncached tokens.",
    "queue_ms": "Priced term: the wait behind the work ahead (prefill queued, running "
                "batch, admission, full-batch waits).",
    "kv_ms": "Priced term: KV-cache pressure.",
    "eviction_ms": "The prefill of `evict_blocks`, in ms.",
    "predicted_ttft_ms": "Base + prefill + queue + KV: the TTFT predicted there.",
    "ready": "Whether the worker was routable.",
    "inflight": "Requests this router had sent there that had not finished.",
    "pending_requests": "Of those, the ones without a first token yet.",
    "pending_prefill_tokens": "Their uncached prompt tokens: prefill ahead of a newcomer.",
    "batch_cap_seen": "Largest running count seen while requests waited (the batch size, "
                      "learned).",
}
_PARAMS = {
    "base_ms": "Fixed part of a TTFT (HTTP, Envoy, tokenisation).",
    "prefill_ms_per_token": "Per uncached prompt token, and per prefill token queued ahead.",
    "ms_per_running": "Per running sequence in the batch the request joins.",
    "ms_per_queued": "Per request waiting for admission ahead of it.",
}


def _candidate_described() -> dict[str, str]:
    comments = {**field_comments(Candidate), **field_comments(WorkerSnapshot)}
    comments.pop("saved_ms", None)  # the comment above it heads the group of priced terms
    return {**_CANDIDATE, **comments, **_SNAPSHOT_EXTRA}


def _annotations(*classes: type) -> dict[str, str]:
    out: dict[str, str] = {}
    for cls in classes:
        for k, v in cls.__annotations__.items():
            out.setdefault(k, str(v).replace("tuple[int, ...]", "array"))
    out["metrics"] = "object | None"
    out["ttft_params"] = "object | None"
    return out


def _rows(keys: list[str], described: dict[str, str], rec: dict[str, Any],
          types: dict[str, str] | None = None) -> list[list[str]]:
    return [[code(k), code((types or {}).get(k) or _kind(rec.get(k))),
             prose(described.get(k, ""))] for k in keys]


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "bool", int: "int", float: "float", str: "str", list: "array",
            dict: "object"}.get(type(v), type(v).__name__)


def _outcome_types() -> dict[str, str]:
    out = {}
    for k, t in schema.OUTCOME_FIELDS.items():
        ts = t if isinstance(t, tuple) else (t,)
        out[k] = " | ".join(x.__name__ for x in ts)
    return out


def page(_root: Path) -> str:
    rec = example()
    cand = rec["candidates"][0]
    outcome = rec["outcome"]
    metrics = cand["metrics"]
    out_desc = {**dict_comments(schema, "OUTCOME_FIELDS"), **DERIVED}
    top_keys = [*rec.keys(), *(k for k in ("prompt",) if k not in rec)]
    outcome_keys = [*outcome.keys(), *(k for k in schema.OUTCOME_FIELDS if k not in outcome)]
    params = {f: _PARAMS.get(f, "") for f in schema.PARAMS_FIELDS}
    params.update(field_comments(TTFTParams))
    ann = _annotations(Candidate, WorkerSnapshot)
    return "\n".join([
        "# Decision record\n",
        generated_note("src/cachepilot/records/schema.py", "src/cachepilot/core/decision.py",
                       "src/cachepilot/core/workers.py"),
        f"One JSON object per routing decision, schema version **{schema.SCHEMA_VERSION}** "
        f"(this version reads {', '.join(map(str, schema.READABLE_SCHEMAS))}; replay needs "
        f"{schema.SCHEMA_VERSION}). The gateway writes them with `--decision-log DIR` (an "
        "LMDB directory); `cachepilot explain`, `cachepilot decisions` and `cachepilot "
        "replay` read them, and `GET /decisions/{id}` serves one. Prompt text is never "
        "stored unless `--capture-prompts` is on. [Decision records](../decisions.md) "
        "covers storage and replay.\n",
        "## Record\n",
        table(["key", "type", "meaning"], _rows(top_keys, TOP, rec, {"prompt": "str",
                                                                     "outcome": "object"})),
        "## Candidate\n",
        "One per worker in the pool: the features read from its state, the priced terms "
        "(ms of time to first token) and the worker snapshot replay rebuilds it from.\n",
        table(["key", "type", "meaning"], _rows(list(cand), _candidate_described(), cand, ann)),
        "### Candidate `metrics`\n",
        table(["key", "type", "meaning"], _rows(list(metrics), field_comments(WorkerMetrics),
                                                metrics, _annotations(WorkerMetrics))),
        "### Candidate `ttft_params`\n",
        table(["key", "meaning"], [[code(k), prose(v)] for k, v in params.items()]),
        "## Outcome\n",
        "Reported by the driver as the response arrives and ends; later reports add to "
        "earlier ones. Every field is optional.\n",
        table(["key", "type", "meaning"], _rows(outcome_keys, out_desc, outcome,
                                                {**_outcome_types(), "extra": "object"})),
        "## Example\n",
        "A record of a two-worker pool, as `GET /decisions/{id}` returns it (made by the "
        "schema's own code when this page is built; the values are illustrative):\n",
        "```json\n" + _json(rec) + "\n```\n",
    ])


def _json(rec: dict[str, Any]) -> str:

    short = _rounded(rec)
    short["hashes"] = rec["hashes"][:48] + "…"
    short["candidates"] = rec["candidates"][:1] + (["…"] if len(rec["candidates"]) > 1 else [])
    return json.dumps(short, indent=2, ensure_ascii=False)


def _rounded(v: Any) -> Any:
    """Floats to 3 decimals, for reading."""
    if isinstance(v, float):
        return round(v, 3)
    if isinstance(v, dict):
        return {k: _rounded(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_rounded(x) for x in v]
    return v
