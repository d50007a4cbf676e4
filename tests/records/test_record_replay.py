"""Replay, explain and stats over recorded decisions."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from cachepilot.cli import main
from cachepilot.core import (
    InferenceRequest,
    Pool,
    PoolSpec,
    Router,
    RoutingError,
    Weights,
    WorkerMetrics,
)
from cachepilot.core.cost import parse_weights
from cachepilot.core.lifecycle import Outcome
from cachepilot.core.workers import TTFTParams
from cachepilot.records import Recorder, open_log
from cachepilot.records.explain import plain_reason, summary
from cachepilot.records.replay import Replayer, replay, replay_policy
from cachepilot.records.stats import summarize

POLICIES = ("priced", "round_robin", "least_loaded", "overlap_only")
ERRORS_MS = (-30.0, 5.0, 12.0, 60.0, -8.0)


def record_run(path: Path, policy: str, n: int = 300, seed: int = 7,
               weights: Weights | None = None) -> list[str]:
    """Route ``n`` requests of 12 shared prefixes over 4 workers whose metrics move (some
    stale, one briefly not ready, calibrated overrides on one), recording everything."""
    rng = random.Random(seed)
    pool = Pool(PoolSpec(name=f"p-{policy}", policy=policy, weights=weights or Weights()))
    addrs = [f"10.0.0.{i}:8000" for i in range(1, 5)]
    for a in addrs:
        pool.upsert_worker(a)
    pool.workers[addrs[2]].ttft = TTFTParams(25.0, 0.11, 0.5, 90.0)  # a learned model
    router = Router([pool], id_prefix=policy)
    ids = []
    with Recorder(path) as rec:
        for i in range(n):
            now = i * 0.05
            if i % 5 == 0:
                for j, a in enumerate(addrs):
                    scraped = now - (9.0 if (j == 3 and 100 <= i < 130) else 0.02)
                    pool.update_metrics(a, WorkerMetrics(
                        waiting=rng.randint(0, 4), running=rng.randint(0, 12),
                        kv_usage=rng.choice((0.1, 0.5, 0.85, 0.95)), num_blocks=4000,
                        scraped_at=scraped))
                pool.set_ready(addrs[0], not (200 <= i < 210))
            group = rng.randint(0, 11)
            prompt = f"system prompt of tenant {group}. " * 30 + f"question {rng.random()}"
            try:
                d = router.route(InferenceRequest(model="m", prompt=prompt), now)
            except RoutingError:
                continue
            rec.decision(d, pool, prompt=prompt)
            if i % 3:
                router.first_token(d)
                # Measured = predicted + a known error, so stats can be checked exactly.
                rec.outcome(d.id, Outcome(status=200, ttft_kind="first_token",
                            ttft_ms=d.winner.predicted_ttft_ms + ERRORS_MS[i % len(ERRORS_MS)],
                            cached_tokens=d.winner.matched_tokens if rng.random() < 0.9 else 0))
            if i % 2:
                router.release(d)
            ids.append(d.id)
    return ids


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("logs")
    out = {}
    for p in POLICIES:
        record_run(root / p, p)
        out[p] = root / p
    record_run(root / "mixed", "priced", n=150)
    record_run(root / "mixed", "least_loaded", n=150, seed=8)
    out["mixed"] = root / "mixed"
    return out


def records(path: Path) -> list[dict[str, Any]]:
    log = open_log(path)
    try:
        return list(log)
    finally:
        log.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_replay_under_recorded_policy_reproduces_every_choice(logs: dict[str, Path],
                                                              policy: str) -> None:
    recs = records(logs[policy])
    assert len(recs) > 250
    report = replay(recs)
    assert report.replayed == len(recs) and report.skipped == 0
    assert report.changed == 0
    assert report.mean_ttft_diff_ms == 0.0
    assert replay(recs, policy).changed == 0  # named explicitly: the same


def test_replay_rebuilds_the_inputs_and_decide_reprices_them_exactly(
        logs: dict[str, Path]) -> None:
    """Router.decide on the rebuilt inputs gives back every recorded term, stale, not-ready
    and calibrated workers included: the record holds what the router read."""
    recs = records(logs["priced"])
    assert any(c["ttft_params"] for c in recs[0]["candidates"])
    assert any(c["filtered"] == "stale" for r in recs for c in r["candidates"])
    assert any(c["filtered"] == "not_ready" for r in recs for c in r["candidates"])
    rp = Replayer(replay_policy("priced"))
    terms = ("eligible", "filtered", "matched_blocks", "waiting", "running", "queued",
             "batch_waits", "kv_usage", "saved_ms", "prefill_ms", "queue_ms", "kv_ms",
             "predicted_ttft_ms", "value")
    for rec in recs:
        d = rp.decide(rec)
        assert d is not None and d.chosen == rec["chosen"] and d.margin_ms == rec["margin_ms"]
        for c, want in zip(d.candidates, rec["candidates"], strict=True):
            assert {t: getattr(c, t) for t in terms} == {t: want[t] for t in terms}, rec["id"]
    # A cost override goes through the same pricing: doubling the default prefill rate
    # doubles the prefill term of uncalibrated workers only.
    rec = recs[-1]
    doubled = Replayer(replay_policy("priced"), cost={"prefill_ms_per_token": 0.16}).decide(rec)
    assert doubled is not None
    for c, want in zip(doubled.candidates, rec["candidates"], strict=True):
        factor = 1.0 if want["ttft_params"] else 2.0
        assert c.prefill_ms == pytest.approx(factor * want["prefill_ms"])


def test_a_record_from_before_the_full_batch_wait_was_learned_still_reads() -> None:
    """Records written before TTFTParams gained ms_per_batch_wait read it as 0: they never
    priced a full batch apart."""
    from cachepilot.records.schema import record_to_candidates
    old = {"candidates": [{"worker": "w:1", "queued": 2, "ttft_params": {
        "base_ms": 20.0, "prefill_ms_per_token": 0.1, "ms_per_running": 0.2,
        "ms_per_queued": 40.0}}]}
    (c,) = record_to_candidates(old)
    assert c.batch_waits == 0
    assert c.state.ttft == TTFTParams(20.0, 0.1, 0.2, 40.0, 0.0)


def test_replay_mixed_policies_log(logs: dict[str, Path]) -> None:
    recs = records(logs["mixed"])
    assert {r["policy"] for r in recs} == {"priced", "least_loaded"}
    assert replay(recs).changed == 0
    assert replay(recs, "round_robin").changed > 0


def test_replay_other_policy_or_weights_changes_decisions(logs: dict[str, Path]) -> None:
    recs = records(logs["priced"])
    rr = replay(recs, "round_robin")
    assert rr.changed > len(recs) // 3
    assert rr.mean_ttft_diff_ms > 0  # priced picked the lower predicted TTFT
    assert sum(rr.new_share.values()) == len(recs)
    no_load = replay(recs, weights=parse_weights("load=0"))
    assert no_load.changed > 0
    assert no_load.mean_ttft_diff_ms >= 0
    assert replay(recs, weights=parse_weights("prefill=1,load=1,kv=1")).changed == 0
    with pytest.raises(ValueError, match="weight"):
        parse_weights("speed=3")


def test_replay_cli_is_deterministic(logs: dict[str, Path]) -> None:
    runner = CliRunner()
    for args in (["--policy", "least_loaded", "--json"], ["--weights", "load=3"],
                 ["--cost", "queue_ms_per_waiting=400"]):
        a = runner.invoke(main, ["replay", str(logs["priced"]), *args])
        b = runner.invoke(main, ["replay", str(logs["priced"]), *args])
        assert a.exit_code == 0, a.output
        assert a.output == b.output
    bad = runner.invoke(main, ["replay", str(logs["priced"]), "--policy", "nope"])
    assert bad.exit_code != 0 and "nope" in bad.output


def test_explain_is_deterministic_and_complete(logs: dict[str, Path]) -> None:
    recs = records(logs["priced"])
    rec = next(r for r in recs if r["outcome"] and r["margin_ms"] > 1
               and sum(c["eligible"] for c in r["candidates"]) > 1)
    runner = CliRunner()
    args = ["explain", rec["id"], "--log", str(logs["priced"])]
    a = runner.invoke(main, args, env={"COLUMNS": "200"})
    b = runner.invoke(main, args, env={"COLUMNS": "200"})
    assert a.exit_code == 0, a.output
    assert a.output == b.output
    assert f"★ {rec['chosen']}" in a.output
    assert f"by {rec['margin_ms']:.1f} over" in a.output
    assert f"measured {rec['outcome']['ttft_ms']:.1f} ms" in a.output
    assert f"why: {plain_reason(rec)}" in " ".join(a.output.split())
    s = summary(rec)
    assert s["chosen"] == rec["chosen"] and s["reason"] == plain_reason(rec)
    assert s["measured_ttft_ms"] == rec["outcome"]["ttft_ms"] and s["runner_up"] != rec["chosen"]
    last = runner.invoke(main, ["explain", "last", "--log", str(logs["priced"])])
    assert recs[-1]["chosen"] in last.output
    missing = runner.invoke(main, ["explain", "zzz", "--log", str(logs["priced"])])
    assert missing.exit_code != 0 and "no decision" in missing.output



def test_explain_saves_what_it_prints_as_svg(logs: dict[str, Path], tmp_path: Path) -> None:
    rec = records(logs["priced"])[-1]
    runner = CliRunner()
    out = tmp_path / "explain.svg"
    res = runner.invoke(main, ["explain", "last", "--log", str(logs["priced"]),
                               "--svg", str(out)])
    assert res.exit_code == 0, res.output
    svg = out.read_text()
    assert svg.lstrip().startswith("<svg")
    # rich writes spaces as &#160; and colours numbers in runs of their own.
    assert "cachepilot&#160;explain&#160;last" in svg and "★" in svg
    assert rec["chosen"].split(".")[0] in svg
    bad = runner.invoke(main, ["explain", "last", "--log", str(logs["priced"]),
                               "--svg", str(tmp_path / "no-such-dir" / "x.svg")])
    assert bad.exit_code != 0 and "cannot write" in bad.output and "Traceback" not in bad.output
    both = runner.invoke(main, ["explain", "last", "--log", str(logs["priced"]), "--json",
                                "--svg", str(out)])
    assert both.exit_code == 2 and "cannot go with --json" in both.output

def _rec(policy: str, chosen: dict[str, Any], other: dict[str, Any],
         margin: float) -> dict[str, Any]:
    base = {"eligible": True, "filtered": None, "matched_blocks": 0, "matched_tokens": 0,
            "waiting": 0, "running": 0, "inflight": 0, "kv_usage": 0.0,
            "metrics_age_ms": 10.0, "saved_ms": 0.0, "prefill_ms": 100.0, "queue_ms": 0.0,
            "kv_ms": 0.0, "predicted_ttft_ms": 115.0, "value": 0.0}
    return {"policy": policy, "chosen": "a", "margin_ms": margin, "seq": 3, "tokens": 1250,
            "weights": {"prefill": 1.0, "load": 1.0, "kv": 1.0},
            "candidates": [{**base, "worker": "a", **chosen}, {**base, "worker": "b", **other}]}


def test_plain_reason_names_what_decided() -> None:
    cached = _rec("priced", {"matched_tokens": 1024, "saved_ms": 82.0, "queue_ms": 30.0,
                             "value": 52.0, "predicted_ttft_ms": 63.0}, {"value": 0.0}, 52.0)
    why = plain_reason(cached)
    assert why.startswith("a beat b by 52 ms")
    assert "cached prefix (1024 vs 0 cached tokens, +82 ms)" in why
    assert "despite queue (30 vs 0 ms, -30 ms)" in why
    queue = _rec("priced", {"queue_ms": 10.0, "value": -10.0},
                 {"queue_ms": 300.0, "value": -300.0}, 290.0)
    assert "shorter queue (10 vs 300 ms, +290 ms)" in plain_reason(queue)
    tie = _rec("priced", {"value": 1.0}, {"value": 0.8}, 0.2)
    assert "tied" in plain_reason(tie) and "hash" in plain_reason(tie)
    ll = _rec("least_loaded", {"waiting": 1, "value": -1.0}, {"waiting": 5, "value": -5.0}, 4.0)
    assert "least loaded: a had 1" in plain_reason(ll)
    only = _rec("priced", {}, {"eligible": False, "filtered": "stale"}, 0.0)
    assert plain_reason(only) == "a was the only eligible worker (others: 1 stale)."


def test_stats_summary_and_plot(logs: dict[str, Path], tmp_path: Path) -> None:
    recs = records(logs["priced"])
    s = summarize(recs)
    assert s["decisions"] == len(recs)
    assert sum(w["decisions"] for w in s["workers"].values()) == len(recs)
    with_report = [r for r in recs if r["outcome"] and "cached_tokens" in r["outcome"]]
    assert s["hit_rate"]["with_report"] == len(with_report)
    measured = sum(r["outcome"]["cached_tokens"] > 0 for r in with_report) / len(with_report)
    assert s["hit_rate"]["measured"] == pytest.approx(measured)
    assert s["hit_rate"]["predicted"] == pytest.approx(
        sum(r["predicted_hit"] for r in recs) / len(recs))
    # Every reported TTFT was predicted + one of ERRORS_MS: the error's median is theirs.
    errors = [abs(r["outcome"]["ttft_ms"] - r["predicted_ttft_ms"]) for r in recs
              if r["outcome"] and "ttft_ms" in r["outcome"]]
    assert set(round(e, 6) for e in errors) == {abs(e) for e in ERRORS_MS}
    assert s["ttft"]["abs_error_p50_ms"] == pytest.approx(float(np.median(errors)))
    out = tmp_path / "stats.png"
    res = CliRunner().invoke(main, ["decisions", "stats", str(logs["priced"]),
                                    "--plot", str(out)])
    assert res.exit_code == 0, res.output
    assert "prefix hit rate" in res.output and out.stat().st_size > 10_000
    listed = CliRunner().invoke(main, ["decisions", "list", str(logs["priced"]), "-n", "3"])
    assert listed.output.count("\n") == 3 and recs[-1]["id"] in listed.output


def test_simulator_log_replays_and_simulates(tmp_path: Path) -> None:
    sim = pytest.importorskip("cachepilot.sim")
    from cachepilot.sim.replay_log import simulate_log

    wl = sim.generate(sim.WorkloadSpec(rate=15, duration=12), 3)
    for policy in ("priced", "least_loaded"):
        path = tmp_path / policy
        with Recorder(path, source="sim") as rec:
            run = sim.Simulator(sim.SimConfig(workers=3, policy=policy), sink=rec).run(wl)
        recs = records(path)
        assert len(recs) == len(run.results)
        assert all(r["outcome"]["ttft_kind"] == "first_token" for r in recs)
        assert replay(recs).changed == 0  # the learned TTFT models are in the record
    result = simulate_log(recs, policy="round_robin")
    mean = sum(o.ttft_s for o in run.results) / len(run.results)
    # Same arrivals, same policy, same engine model: the simulator reproduces the run.
    assert result["simulated"]["recorded_policy"]["ttft_mean_s"] == pytest.approx(mean)
    assert result["simulated"]["replayed_policy"]["policy"] == "round_robin"


def test_empty_log_commands(tmp_path: Path) -> None:
    Recorder(tmp_path / "empty").close()
    runner = CliRunner()
    for args in (["decisions", "stats"], ["replay"], ["decisions", "list"]):
        res = runner.invoke(main, [*args, str(tmp_path / "empty")])
        assert res.exit_code == 0, (args, res.output)
    res = runner.invoke(main, ["explain", "last", "--log", str(tmp_path / "empty")])
    assert res.exit_code != 0 and "no decision" in res.output
    res = runner.invoke(main, ["decisions", "stats", str(tmp_path / "nothing-here")])
    assert res.exit_code != 0 and "no decision log" in res.output
