"""Re-decide recorded requests through the routing core's own ``Router.decide``.

Each record is turned back into the router's inputs as they were: a pool with the recorded
cost model, weights, policy and decision counter; every worker, in the recorded order, with
the snapshot it was priced from (readiness, the scrape in force, requests in flight,
pending prefill, learned batch size, learned TTFT model); and a directory in which each
worker holds the blocks of the request's prefix it was matched on. Then the same ``decide``
the gateway and the simulator use prices and picks, with the decision id as tie key. Under
the recorded policy, weights and cost model every choice comes back; under others, the same
code answers "what then".

This is a static replay: a different choice would have changed the queues and caches seen by
later requests, which the recorded state cannot know. ``--simulate`` runs the counterfactual
through the simulator instead.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from cachepilot.core.cost import CostModel, Weights
from cachepilot.core.decision import Decision, RoutingError
from cachepilot.core.fingerprint import BlockConfig, Fingerprint
from cachepilot.core.policies import Policy, make_policy
from cachepilot.core.pool import Pool, PoolSpec
from cachepilot.core.router import Router
from cachepilot.records.schema import record_hashes, record_to_candidates

_COST_FIELDS = {f.name for f in fields(CostModel)}
_WEIGHT_FIELDS = {f.name for f in fields(Weights)}


def recorded_cost(record: Mapping[str, Any]) -> CostModel:
    """The pool's cost model at the time, or the defaults if the recorder had no pool."""
    return CostModel(**{k: v for k, v in (record.get("cost") or {}).items() if k in _COST_FIELDS})


_FLOW_FILTERS = ("closed", "slo")  # cachepilot.core.flow.gate.CLOSED, core.flow.slo.SLO


class Replayer:
    """Re-decides records with one policy: each record's pool rebuilt through
    :meth:`Pool.restored` from the worker snapshots it stores, then the router's own
    ``decide``."""

    def __init__(self, policy: Policy, *, weights: Mapping[str, float] | None = None,
                 cost: Mapping[str, float] | None = None) -> None:
        self.policy = policy
        self.weights = dict(weights or {})
        self.cost = dict(cost or {})
        self.router = Router(id_prefix="replay")

    def rebuild(self, record: Mapping[str, Any]) -> tuple[Pool, Fingerprint]:
        """The pool in the state the record was decided in, and the request's fingerprint."""
        if record.get("schema_version", 1) < 2:
            raise ValueError(f"record {record.get('id')} has schema "
                             f"{record.get('schema_version')}: replay needs the worker state "
                             "recorded since schema 2 (explain and stats still read it)")
        hashes = tuple(record_hashes(record))
        weights = Weights(**{**{k: v for k, v in record["weights"].items()
                                if k in _WEIGHT_FIELDS}, **self.weights})
        # Room for the whole prefix: inserting what a worker was matched on evicts nothing.
        spec = PoolSpec(name=record["pool"], models=(record["model"],),
                        policy=self.policy.name, weights=weights,
                        cost=recorded_cost(record).with_(**self.cost),
                        block=BlockConfig(block_size=record["block_size"]),
                        capacity_blocks=len(hashes) + 1)
        cands = record_to_candidates(record)
        pool = Pool.restored(
            spec, self.policy, (c.state for c in cands), seq=record["seq"],
            now=record["time"], arrival_rate=record.get("arrival_rate", 0.0),
            typical_uncached=record.get("typical_uncached", 0.0),
            held={c.worker: hashes[:c.matched_blocks] for c in cands},
            evictions={c.worker: c.evict_blocks for c in cands})
        self.router.pools = {pool.name: pool}
        return pool, Fingerprint(hashes, record["tokens"], record["block_size"])

    def decide(self, record: Mapping[str, Any]) -> Decision | None:
        """The decision the router makes on the record's inputs (None: no eligible worker).
        Workers the proxy's subset hint left out then are left out again."""
        pool, fp = self.rebuild(record)
        subset = {c["worker"] for c in record["candidates"] if c.get("filtered") != "subset"}
        only = subset if len(subset) < len(record["candidates"]) else None
        # Workers flow control had closed (or ruled out for a TTFT target) stay out too.
        excluded = {c["worker"]: c["filtered"] for c in record["candidates"]
                    if c.get("filtered") in _FLOW_FILTERS} or None
        try:
            return self.router.decide(pool, record["model"], fp, record["time"], record["id"],
                                      only=only, excluded=excluded)
        except RoutingError:
            return None


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


def redecide(record: Mapping[str, Any], replayer: Replayer) -> tuple[Redecision, Decision] | None:
    """Re-decide one record. None if no candidate was eligible (nothing to choose)."""
    d = replayer.decide(record)
    if d is None:
        return None
    by_worker = {c.worker: c for c in d.candidates}
    recorded = by_worker.get(record["chosen"])
    return Redecision(
        id=record["id"], recorded=record["chosen"], chosen=d.chosen, margin_ms=d.margin_ms,
        recorded_ttft_ms=(recorded.predicted_ttft_ms if recorded is not None
                          else float("nan")),
        new_ttft_ms=d.winner.predicted_ttft_ms,
    ), d


def replay_policy(name: str) -> Policy:
    """A fresh live policy for replay. The simulator's peer models keep routing state that a
    record cannot rebuild: ValueError, pointing at ``--simulate``."""
    try:
        return make_policy(name)
    except ValueError as exc:
        raise ValueError(f"{exc} (the simulator's peer models replay only with "
                         "--simulate)") from None


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
    """Re-decide every record. ``policy`` None keeps each record's own policy."""
    replayers: dict[str, Replayer] = {}
    report = ReplayReport(policy=policy or "recorded", weights=dict(weights or {}),
                          cost=dict(cost or {}))
    for rec in records:
        report.total += 1
        name = policy or rec["policy"]
        rp = replayers.get(name)
        if rp is None:
            rp = replayers[name] = Replayer(replay_policy(name), weights=weights, cost=cost)
        result = redecide(rec, rp)
        if result is None:
            report.skipped += 1
            continue
        r, _ = result
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
    return report

