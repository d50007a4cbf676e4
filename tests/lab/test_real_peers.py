"""The real-worker peers study: its pure logic (router command lines, phase order, engine
counters, paired statistics, the issue's bar, outputs) in the fast suite; one tiny real run
(llama.cpp and both peer routers) marked slow."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from cachepilot.lab import real_peers as study
from cachepilot.lab import real_peers_report as study_report
from cachepilot.lab.output import StudyOutput
from cachepilot.tooling.llamacpp.routers import ROUTERS, PeerRouterMissing, peers_installed

from helpers.paths import DATA


def test_peer_command_lines_keep_their_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    for name, sub, quiet in (("sglang_cache_aware", ["launch"], "warn"),
                             ("vllm_cache_aware", [], "warning")):
        spec = ROUTERS[name]
        monkeypatch.setattr(type(spec), "launcher", lambda self: Path(f"/bin/{self.kind}"))
        args = spec.args(7, 8, urls)
        assert args[:1 + len(sub)] == [f"/bin/{spec.kind}", *sub]
        i = args.index("--worker-urls")
        assert args[i + 1:i + 3] == urls
        assert args[args.index("--policy") + 1] == "cache_aware"
        assert args[args.index("--log-level") + 1] == quiet
        # Nothing that would change how their cache-aware policy decides.
        assert not any(a.startswith(("--cache-threshold", "--balance", "--eviction",
                                     "--max-tree")) for a in args)


def test_missing_peer_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", "/nonexistent/bin/python")
    with pytest.raises(PeerRouterMissing, match="sglang-router"):
        ROUTERS["sglang_cache_aware"].launcher()
    assert "vllm-router" in (peers_installed(["cachepilot", "vllm_power_of_two"]) or "")
    assert peers_installed(["cachepilot", "round_robin"]) is None


def test_order_rotates_so_every_router_takes_every_position() -> None:
    routers = ("a", "b", "c")
    orders = [study.order(routers, c) for c in range(3)]
    assert orders[0] == ["a", "b", "c"] and orders[1] == ["b", "c", "a"]
    for pos in range(3):
        assert {o[pos] for o in orders} == set(routers)


def test_engine_counters_give_hit_rate_and_token_imbalance(
        monkeypatch: pytest.MonkeyPatch) -> None:
    text = (DATA / "llamacpp_metrics.txt").read_text()
    monkeypatch.setattr(study, "http_get", lambda url, timeout: (200, text.encode()))
    c = study.engine_counters("127.0.0.1:1")
    assert c == {"asked": 566 + 530, "cached": 530}  # llama.cpp counts processed apart
    s = study._engine_summary([{"asked": 0, "cached": 0}] * 2,
                              [{"asked": 300, "cached": 0}, {"asked": 100, "cached": 50}])
    assert s["engine_prompt_tokens"] == [300, 100]
    assert s["imbalance"] == 1.5 and s["engine_token_hit_rate"] == 0.125


def test_vllm_counters_are_its_prefix_cache_queries_and_hits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    text = ("# TYPE vllm:prefix_cache_queries counter\n"
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1472.0\n'
            "# TYPE vllm:prefix_cache_hits counter\n"
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1440.0\n')
    monkeypatch.setattr(study, "http_get", lambda url, timeout: (200, text.encode()))
    assert study.engine_counters("127.0.0.1:1", "vllm") == {"asked": 1472, "cached": 1440}


def test_requests_go_as_chat_or_text_completions() -> None:
    from cachepilot.lab import real_traffic as wl

    req = wl.requests(n=1)[0]
    chat = wl.body(req, "chat")
    text = wl.body(req, "completions")
    assert chat["messages"][0]["role"] == "system" and "prompt" not in chat
    assert text["prompt"] == "\n".join(m["content"] for m in chat["messages"])
    assert text["stream"] and text["stream_options"] == {"include_usage": True}
    assert wl.APIS == {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def test_seeds_are_a_count_a_range_or_a_list() -> None:
    import click

    from cachepilot.cli.experiments import seed_list

    assert seed_list("3") == (11, 12, 13)
    assert seed_list("201-205") == (201, 202, 203, 204, 205)
    assert seed_list("7,9") == (7, 9)
    with pytest.raises(click.BadParameter):
        seed_list("x")


def _phase(workload: str, seed: int, router: str, p50: float, p90: float, hit: float
           ) -> dict[str, Any]:
    return {"workload": workload, "seed": seed, "router": router, "ttft_p50_s": p50,
            "ttft_p90_s": p90, "ttft_p99_s": p90 * 1.2, "ttft_mean_s": p50,
            "token_hit_rate": hit, "imbalance": 1.1, "errors": 0,
            "loadavg_1m": [1.0, 1.5]}


def _data(ours_p50: list[float], ours_hit: float) -> dict[str, Any]:
    routers = ["cachepilot", "sglang_cache_aware", "round_robin"]
    phases = []
    for i, seed in enumerate((11, 12, 13)):
        phases += [_phase("shared", seed, "cachepilot", ours_p50[i], 2.0 + i / 10, ours_hit),
                   _phase("shared", seed, "sglang_cache_aware", 1.0 + i / 10, 2.0 + i / 10,
                          0.5),
                   _phase("shared", seed, "round_robin", 3.0, 4.0, 0.2)]
    return {"config": {"routers": routers, "workloads": ["shared"], "seeds": [11, 12, 13],
                       "requests": 5, "workers": 2},
            "workloads": {"shared": {"kind": "shared_prefix", "rate": 0.4}},
            "phases": phases, "samples": [], "wall_s": 60.0}


def test_paired_difference_called_only_when_the_interval_excludes_zero() -> None:
    better = study_report.analyse(_data([0.5, 0.6, 0.7], 0.6))["shared"]
    d = better["vs"]["sglang_cache_aware"]["ttft_p50_s"]
    # A ratio: the geometric mean of 0.5/1.0, 0.6/1.1, 0.7/1.2, as a change.
    assert d["significant"] and d["rel"] == pytest.approx((0.5 * 0.6 * 0.7 / 1.32) ** (1 / 3) - 1)
    assert d["rel_lo"] > -1.0  # never below -100 %, however noisy
    assert study_report.verdict(d) == "**better**"
    assert better["bar"]["ttft_p50_s"] == {"best_peer": "sglang_cache_aware", "ours": 0.6,
                                           "theirs": pytest.approx(1.1), "bar": 0.9,
                                           "means": True, "not_worse": True}
    # The median must be at most 0.9x the best peer's: 1.05 against 1.1 is not enough.
    close = study_report.analyse(_data([1.0, 1.05, 1.1], 0.5))["shared"]
    assert not close["bar"]["ttft_p50_s"]["means"]
    assert close["bar"]["token_hit_rate"]["means"]  # 0.5 against 0.5: within 1 point
    # round robin is a router, not a peer: the bar is against sglang only.
    assert better["bar"]["token_hit_rate"]["best_peer"] == "sglang_cache_aware"
    noisy = study_report.analyse(_data([0.5, 1.8, 1.0], 0.5))["shared"]
    n = noisy["vs"]["sglang_cache_aware"]["ttft_p50_s"]
    assert not n["significant"] and study_report.verdict(n) == "n.s."
    assert noisy["bar"]["ttft_p50_s"]["not_worse"]
    worse = study_report.analyse(_data([1.5, 1.6, 1.7], 0.4))["shared"]
    assert not worse["bar"]["ttft_p50_s"]["means"]
    assert not worse["bar"]["ttft_p50_s"]["not_worse"]
    assert not worse["bar"]["token_hit_rate"]["not_worse"]  # 0.4 < 0.5 every seed


def test_a_difference_is_bold_only_when_it_survives_holm() -> None:
    """Raw p < 0.05 but not after Holm over the report's comparisons: plain, not bold."""
    d = {"significant": True, "significant_holm": False, "mean": -0.1}
    assert study_report.verdict(d) == "better"
    assert study_report.verdict({**d, "significant_holm": True}) == "**better**"
    assert study_report.verdict({**d, "mean": 0.1}, lower_better=False) == "better"
    stats = study_report.analyse(_data([0.8, 1.2, 0.9], 0.5))
    family = study_report.tests(stats)
    assert len(family) == 2 * 4  # 2 other routers x p50, p90, p99, hit rate
    assert all("p_holm" in t and t["p_holm"] >= t["p"] for t in family if t["p"] == t["p"])
    assert "after Holm's adjustment over all 8" in study_report.holm_summary(stats)


def test_outputs_are_written_with_the_command(tmp_path: Path) -> None:
    data = _data([0.5, 0.6, 0.7], 0.6)
    output = StudyOutput(tmp_path, "cachepilot experiment real-peers -x")
    stats = study_report.write_outputs(data, output)
    assert set(stats) == {"shared"}  # one workload: nothing to pool
    doc = orjson.loads((tmp_path / "results.json").read_bytes())
    assert doc["command"] == "cachepilot experiment real-peers -x"
    assert doc["stats"]["shared"]["cells"] == 3
    md = (tmp_path / "report.md").read_text()
    assert "`cachepilot experiment real-peers -x`" in md
    assert "| sglang_cache_aware | -46% [" in md and "**better**" in md
    assert "after Holm's adjustment over all 8" in md
    assert (tmp_path / "real_peers.png").stat().st_size > 10_000
    assert "router CPU" not in md  # not measured before 2026-12-07: no column


def test_the_routers_cpu_is_a_column_when_measured(tmp_path: Path) -> None:
    data = _data([0.5, 0.6, 0.7], 0.6)
    for p in data["phases"]:
        p["router_cpu_ms_per_request"] = {"cachepilot": 9.0, "sglang_cache_aware": 2.5,
                                          "round_robin": 8.0}[p["router"]] + p["seed"] - 12
    study_report.write_outputs(data, StudyOutput(tmp_path, "x"))
    md = (tmp_path / "report.md").read_text()
    assert "| errors | router CPU ms/request |" in md
    rows: dict[str, str] = {}  # the first table's rows
    for line in md.splitlines():
        if line.startswith("| "):
            rows.setdefault(line.split(" | ")[0], line)
    assert rows["| cachepilot"].endswith(" 9.0 |")  # the mean over seeds 11–13
    assert rows["| sglang_cache_aware"].endswith(" 2.5 |")


def test_a_report_is_rewritten_from_its_own_data(tmp_path: Path) -> None:
    """--rewrite-report: the same report from results.json and samples.json, no workers;
    a folder without them is one line of error."""
    from click.testing import CliRunner

    from cachepilot.cli import main

    data = _data([0.5, 0.6, 0.7], 0.6)
    study_report.write_outputs(data, StudyOutput(tmp_path, "cachepilot experiment real-peers -x"))
    before = (tmp_path / "report.md").read_text()
    (tmp_path / "report.md").write_text("stale")
    runner = CliRunner()
    ok = runner.invoke(main, ["experiment", "real-peers", "--out", str(tmp_path),
                              "--rewrite-report"])
    assert ok.exit_code == 0, ok.output
    assert (tmp_path / "report.md").read_text() == before
    bad = runner.invoke(main, ["experiment", "real-peers", "--out", str(tmp_path / "none"),
                               "--rewrite-report"])
    assert bad.exit_code == 1 and "not a real-peers study's output" in bad.output
    assert "Traceback" not in bad.output


def test_runs_on_other_seeds_are_pooled_into_one_report(tmp_path: Path) -> None:
    """--pool: two runs of the same study on different seeds give one report over every
    cell; runs that share a seed or differ in anything else are refused in one line."""
    from click.testing import CliRunner

    from cachepilot.cli import main

    a, b = _data([0.5, 0.6, 0.7], 0.6), _data([0.9, 1.0, 0.8], 0.6)
    for p in b["phases"]:
        p["seed"] += 10
    b["config"]["seeds"] = [21, 22, 23]
    study_report.write_outputs(a, StudyOutput(tmp_path / "a", "cachepilot run-a"))
    study_report.write_outputs(b, StudyOutput(tmp_path / "b", "cachepilot run-b"))
    runner = CliRunner()
    ok = runner.invoke(main, ["experiment", "real-peers", "--pool", str(tmp_path / "a"),
                              "--pool", str(tmp_path / "b"), "--out", str(tmp_path / "ab")])
    assert ok.exit_code == 0, ok.output
    doc = orjson.loads((tmp_path / "ab" / "results.json").read_bytes())
    assert doc["config"]["seeds"] == [11, 12, 13, 21, 22, 23]
    assert doc["stats"]["shared"]["cells"] == 6
    assert [r["command"] for r in doc["pooled_from"]] == ["cachepilot run-a", "cachepilot run-b"]
    md = (tmp_path / "ab" / "report.md").read_text()
    assert "Pooled from `cachepilot run-a`" in md and "× 6 seeds (11, 12, 13, 21, 22, 23)" in md
    assert doc["command"].startswith("cachepilot experiment real-peers --pool ")
    same = runner.invoke(main, ["experiment", "real-peers", "--pool", str(tmp_path / "a"),
                                "--pool", str(tmp_path / "a"), "--out", str(tmp_path / "aa")])
    assert same.exit_code == 1 and "seeds [11, 12, 13] are in an earlier run" in same.output
    b["config"]["api"] = "completions"
    study_report.write_outputs(b, StudyOutput(tmp_path / "b", "cachepilot run-b"))
    other = runner.invoke(main, ["experiment", "real-peers", "--pool", str(tmp_path / "a"),
                                 "--pool", str(tmp_path / "b"), "--out", str(tmp_path / "x")])
    assert other.exit_code == 1 and "api differ" in other.output
    onto = runner.invoke(main, ["experiment", "real-peers", "--pool", str(tmp_path / "a"),
                                "--pool", str(tmp_path / "ab"), "--out", str(tmp_path / "a")])
    assert onto.exit_code == 1 and "would overwrite a run it reads" in onto.output
    assert "Traceback" not in same.output + other.output + onto.output


@pytest.mark.slow
def test_tiny_real_study(tmp_path: Path) -> None:
    """Two routers (CachePilot, sglang-router) on two real llama-server workers, a few
    requests each: every request answered and counted by the workers."""
    from cachepilot.tooling.llamacpp import installed

    why = installed() or peers_installed(["sglang_cache_aware"])
    if why:
        if os.environ.get("CACHEPILOT_REQUIRE_LLAMACPP"):
            pytest.fail(why)
        pytest.skip(why)
    cfg = study.StudyConfig(workloads=("hotspot",), seeds=(1,), requests=4, rate=1.0,
                            routers=("cachepilot", "sglang_cache_aware"))
    data = study.run_study(cfg, str(tmp_path / "logs"))
    assert [p["router"] for p in data["phases"]] == ["cachepilot", "sglang_cache_aware"]
    for p in data["phases"]:
        assert p["errors"] == 0 and p["requests"] == 4
        assert sum(p["engine_prompt_tokens"]) > 4 * 400  # the workers saw every prompt
        assert p["token_hit_rate"] == pytest.approx(p["engine_token_hit_rate"], abs=0.01)
        # Envoy and the gateway, or sglang-router's launcher and its server, did some work.
        assert p["router_cpu_ms_per_request"] > 0 and p["workers_cpu_s"] > 0
