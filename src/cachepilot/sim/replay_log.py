"""``cachepilot replay LOG --simulate``: the recorded arrivals through the simulator.

Static replay keeps the recorded state; this runs the counterfactual instead: the same
arrivals (time, prompt size, prefix hashes, output length) go through the simulator twice,
under the recorded policy and under the replayed one, on as many modelled engines as the log
had workers. Both runs use the simulator's engine model, so compare them with each other;
the measured TTFTs of the log are shown beside them for scale, not as a like-for-like baseline.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from cachepilot.core.cost import Weights
from cachepilot.core.fingerprint import Fingerprint
from cachepilot.records.replay import recorded_cost
from cachepilot.records.schema import record_hashes
from cachepilot.sim.measures import summarize
from cachepilot.sim.simulator import SimConfig, Simulator
from cachepilot.sim.workloads import BLOCK, SimRequest

DEFAULT_MAX_TOKENS = 128  # when the log has no completion_tokens for a request


def arrivals(records: Iterable[Mapping[str, Any]]) -> tuple[list[Any], list[Mapping[str, Any]]]:
    """SimRequests for the recorded decisions, in time order, arrival 0 at the first."""
    recs = sorted(records, key=lambda r: r["time"])
    if not recs:
        return [], []
    t0 = recs[0]["time"]
    out = []
    for i, rec in enumerate(recs):
        fp = Fingerprint(tuple(record_hashes(rec)), rec["tokens"],
                         rec["block_size"])
        done = (rec.get("outcome") or {}).get("completion_tokens")
        out.append(SimRequest(id=i, arrival=rec["time"] - t0, segments=(),
                              max_tokens=max(1, int(done or DEFAULT_MAX_TOKENS)), fp=fp))
    return out, recs


def simulate_log(records: Iterable[Mapping[str, Any]], *, policy: str | None = None,
                 weights: Mapping[str, float] | None = None,
                 cost: Mapping[str, float] | None = None) -> dict[str, Any]:
    reqs, recs = arrivals(records)
    if not reqs:
        return {"requests": 0}
    sizes = {r["block_size"] for r in recs}
    if sizes != {BLOCK.block_size}:
        raise ValueError(f"the log's block sizes {sorted(sizes)} differ from the simulator's "
                         f"{BLOCK.block_size}")
    first = recs[0]
    workers = sorted({c["worker"] for r in recs for c in r["candidates"]})
    base_weights = Weights(**first["weights"])
    base_cost = recorded_cost(first)
    runs = {}
    for label, pol, w, c in (
        ("recorded_policy", first["policy"], base_weights, base_cost),
        ("replayed_policy", policy or first["policy"],
         Weights(**{**first["weights"], **(weights or {})}), base_cost.with_(**(cost or {}))),
    ):
        cfg = SimConfig(workers=len(workers), policy=pol, weights=w, cost=c)
        res = Simulator(cfg).run(list(reqs))
        s = summarize(res)
        runs[label] = {"policy": pol, "weights": w.to_dict(),
                       **{k: s[k] for k in ("ttft_p50_s", "ttft_p90_s", "ttft_mean_s",
                                            "token_hit_rate", "imbalance_assigned",
                                            "rejected")}}
    measured = [r["outcome"]["ttft_ms"] for r in recs
                if r.get("outcome") and r["outcome"].get("ttft_ms") is not None]
    return {
        "requests": len(reqs),
        "workers": len(workers),
        "simulated": runs,
        "log_measured_ttft_mean_s": (sum(measured) / len(measured) / 1000.0
                                     if measured else None),
    }
