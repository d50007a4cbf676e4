"""Re-decide recorded requests under another policy, weights or cost model.

Each record is re-decided from the state recorded at the time: its Candidate objects are
rebuilt from the record and handed to the routing core's own ``Policy.values`` and ``pick``
with the recorded sequence number and the same tie key (the decision id's hash), so under
the recorded policy and weights every choice is reproduced exactly. With ``cost`` overrides
the priced terms are first recomputed through the core's cost functions
(:mod:`cachepilot.core.cost`) from the recorded inputs.

This is a static replay: a different choice would have changed the queues and caches seen by
later requests, which the recorded state cannot know. ``--simulate`` runs the counterfactual
through the simulator instead.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from xxhash import xxh3_64_intdigest

from cachepilot.core.cost import (
    CostModel,
    Load,
    Weights,
    kv_pressure_ms,
    prefill_ms_per_token,
    queue_ms,
)
from cachepilot.core.decision import Candidate, Decision
from cachepilot.core.fingerprint import BlockConfig
from cachepilot.core.policies import Context, Policy, make_policy, pick
from cachepilot.core.pool import Pool, PoolSpec
from cachepilot.core.workers import WorkerMetrics, WorkerState
from cachepilot.records.schema import record_to_candidates

_COST_FIELDS = {f.name for f in fields(CostModel)}
_WEIGHT_FIELDS = {f.name for f in fields(Weights)}


def recorded_cost(record: Mapping[str, Any]) -> CostModel:
    """The pool's cost model at the time, or the defaults if the recorder had no pool."""
    return CostModel(**{k: v for k, v in (record.get("cost") or {}).items() if k in _COST_FIELDS})


def reprice(record: Mapping[str, Any], cands: list[Candidate],
            overrides: Mapping[str, float]) -> CostModel:
    """Recompute every candidate's priced terms under the recorded cost model with
    ``overrides`` applied, through the core's cost functions. Per-worker calibrated
    parameters stay as recorded. The pending prefill a worker had (not a recorded field) is
    recovered from its recorded queue term."""
    base = recorded_cost(record)
    cost = base.with_(**overrides)
    params = {d["worker"]: d.get("params") or {} for d in record["candidates"]}
    tokens, blocks = record["tokens"], record.get("blocks", len(record.get("hashes", ())))
    for c in cands:
        p = params.get(c.worker, {})
        metrics = WorkerMetrics(num_blocks=p.get("num_blocks"))
        old = WorkerState(address=c.worker, metrics=metrics,
                          prefill_ms_per_token=p.get("prefill_ms_per_token"),
                          queue_ms_per_waiting=p.get("queue_ms_per_waiting"))
        per_token_old = prefill_ms_per_token(old, base)
        per_waiting_old = old.queue_ms_per_waiting or base.queue_ms_per_waiting
        pending_ms = (c.queue_ms - c.waiting * per_waiting_old
                      - c.running * base.queue_ms_per_running)
        old.pending_prefill_tokens = (max(0, round(pending_ms / per_token_old))
                                      if per_token_old > 0 else 0)
        age = None if c.metrics_age_ms is None else c.metrics_age_ms / 1000.0
        load = Load(waiting=c.waiting, running=c.running, kv_usage=c.kv_usage, stale=False,
                    age_s=age)
        per_token = prefill_ms_per_token(old, cost)
        c.saved_ms = c.matched_tokens * per_token
        c.prefill_ms = (tokens - c.matched_tokens) * per_token
        c.queue_ms = queue_ms(load, old, cost)
        c.kv_ms = kv_pressure_ms(load, blocks - c.matched_blocks, old, cost)
        c.predicted_ttft_ms = cost.base_ttft_ms + c.prefill_ms + c.queue_ms + c.kv_ms
    return cost


@dataclass(slots=True)
class Redecision:
    id: str
    recorded: str
    chosen: str
    margin_ms: float
    recorded_ttft_ms: float  # predicted TTFT of the recorded choice (under replay pricing)
    new_ttft_ms: float  # predicted TTFT of the replayed choice

    @property
    def changed(self) -> bool:
        return self.chosen != self.recorded


def redecide(record: Mapping[str, Any], policy: Policy, *,
             weights: Mapping[str, float] | None = None,
             cost: Mapping[str, float] | None = None,
             _cands: list[Candidate] | None = None) -> Redecision | None:
    """Re-decide one record. None if no candidate was eligible (nothing to choose)."""
    cands = record_to_candidates(record) if _cands is None else _cands
    if cost:
        reprice(record, cands, cost)
    eligible = [c for c in cands if c.eligible]
    if not eligible:
        return None
    w = Weights(**{**{k: v for k, v in record["weights"].items() if k in _WEIGHT_FIELDS},
                   **(weights or {})})
    if policy.name == record["policy"]:
        # The learned state the recorded decision used (e.g. the adaptive load weight).
        for key, value in (record.get("extra") or {}).items():
            if isinstance(value, int | float) and hasattr(policy, key):
                setattr(policy, key, value)
    ctx = Context(seq=record["seq"], tokens=record["tokens"], weights=w)
    values = policy.values(eligible, ctx)
    for c, v in zip(eligible, values, strict=True):
        c.value = v
    i, margin = pick(values, policy.tie_tolerance, xxh3_64_intdigest(record["id"].encode()))
    by_worker = {c.worker: c for c in cands}
    recorded = by_worker.get(record["chosen"])
    chosen = eligible[i]
    return Redecision(
        id=record["id"], recorded=record["chosen"], chosen=chosen.worker, margin_ms=margin,
        recorded_ttft_ms=(recorded.predicted_ttft_ms if recorded is not None
                          else float("nan")),
        new_ttft_ms=chosen.predicted_ttft_ms,
    )


_STATEFUL_HOOKS = ("before_route", "after_route", "on_finish")


def replay_policy(name: str, record: Mapping[str, Any]) -> Policy:
    """A fresh policy for replay, bound to a pool shaped like the recorded one. Policies that
    keep routing state of their own (hooks around each route) cannot be rebuilt from the
    record: ValueError."""
    try:
        pol = make_policy(name)
    except ValueError:
        try:  # the simulator's peer models register on import
            import cachepilot.sim.peers  # noqa: F401
        except ImportError:
            raise ValueError(f"unknown policy {name!r}") from None
        pol = make_policy(name)
    hooks = [h for h in _STATEFUL_HOOKS if hasattr(pol, h)]
    if hooks:
        raise ValueError(f"policy {name!r} keeps its own routing state ({', '.join(hooks)}): "
                         "a static replay cannot rebuild it; use --simulate")
    bind = getattr(pol, "bind", None)
    if bind is not None:
        bind(Pool(PoolSpec(name=record["pool"], policy="priced", cost=recorded_cost(record),
                           block=BlockConfig(block_size=record["block_size"]))))
    return pol


def _as_decision(record: Mapping[str, Any], cands: list[Candidate], r: Redecision) -> Decision:
    """A Decision for ``Policy.observe`` (learning policies read the winner's terms)."""
    return Decision(id=record["id"], time=record["time"], pool=record["pool"],
                    model=record["model"], policy=record["policy"],
                    weights=dict(record["weights"]), seq=record["seq"], tokens=record["tokens"],
                    block_size=record["block_size"], hashes=(), candidates=cands,
                    chosen=r.chosen, margin_ms=r.margin_ms, reason="replay")


def imbalance(counts: Mapping[str, int]) -> float:
    """Busiest worker's share over the mean share: 1.0 is perfectly even."""
    if not counts or not sum(counts.values()):
        return 0.0
    return max(counts.values()) / (sum(counts.values()) / len(counts))


@dataclass(slots=True)
class ReplayReport:
    policy: str
    weights: dict[str, float]
    cost: dict[str, float]
    total: int = 0
    replayed: int = 0
    skipped: int = 0  # no eligible candidate
    changed: int = 0
    recorded_ttft_ms: float = 0.0  # sum over replayed decisions
    new_ttft_ms: float = 0.0
    recorded_share: dict[str, int] = field(default_factory=dict)
    new_share: dict[str, int] = field(default_factory=dict)
    changes: list[Redecision] = field(default_factory=list)  # the first few changed ones
    moves: Tally[tuple[str, str]] = field(default_factory=Tally)  # (recorded, replayed) → n

    @property
    def mean_ttft_diff_ms(self) -> float:
        return (self.new_ttft_ms - self.recorded_ttft_ms) / self.replayed if self.replayed else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy, "weights": self.weights, "cost": self.cost,
            "total": self.total, "replayed": self.replayed, "skipped": self.skipped,
            "changed": self.changed,
            "changed_pct": 100.0 * self.changed / self.replayed if self.replayed else 0.0,
            "mean_predicted_ttft_ms": {
                "recorded": self.recorded_ttft_ms / self.replayed if self.replayed else 0.0,
                "replayed": self.new_ttft_ms / self.replayed if self.replayed else 0.0,
                "difference": self.mean_ttft_diff_ms,
            },
            "share": {"recorded": dict(sorted(self.recorded_share.items())),
                      "replayed": dict(sorted(self.new_share.items()))},
            "imbalance": {"recorded": imbalance(self.recorded_share),
                          "replayed": imbalance(self.new_share)},
            "changes": [{"id": r.id, "recorded": r.recorded, "replayed": r.chosen,
                         "recorded_ttft_ms": r.recorded_ttft_ms, "replayed_ttft_ms": r.new_ttft_ms,
                         "margin_ms": r.margin_ms} for r in self.changes],
            "moves": [{"from": a, "to": b, "count": n}
                      for (a, b), n in sorted(self.moves.items(), key=lambda kv: (-kv[1], kv[0]))],
        }


def replay(records: Iterable[Mapping[str, Any]], policy: str | None = None, *,
           weights: Mapping[str, float] | None = None, cost: Mapping[str, float] | None = None,
           keep_changes: int = 10) -> ReplayReport:
    """Re-decide every record. ``policy`` None keeps each record's own policy. A stateful
    policy sees, through ``observe``, the measured TTFT of decisions it reproduced."""
    policies: dict[str, Policy] = {}
    report = ReplayReport(policy=policy or "recorded", weights=dict(weights or {}),
                          cost=dict(cost or {}))
    for rec in records:
        report.total += 1
        name = policy or rec["policy"]
        pol = policies.get(name)
        if pol is None:
            pol = policies[name] = replay_policy(name, rec)
        cands = record_to_candidates(rec)
        r = redecide(rec, pol, weights=weights, cost=cost, _cands=cands)
        if r is None:
            report.skipped += 1
            continue
        report.replayed += 1
        report.recorded_ttft_ms += r.recorded_ttft_ms
        report.new_ttft_ms += r.new_ttft_ms
        for c in rec["candidates"]:
            if c["eligible"]:
                report.recorded_share.setdefault(c["worker"], 0)
                report.new_share.setdefault(c["worker"], 0)
        report.recorded_share[r.recorded] = report.recorded_share.get(r.recorded, 0) + 1
        report.new_share[r.chosen] = report.new_share.get(r.chosen, 0) + 1
        if r.changed:
            report.changed += 1
            report.moves[(r.recorded, r.chosen)] += 1
            if len(report.changes) < keep_changes:
                report.changes.append(r)
        outcome = rec.get("outcome") or {}
        if not r.changed and outcome.get("ttft_ms") is not None:
            pol.observe(_as_decision(rec, cands, r), outcome["ttft_ms"])
    return report

