"""benchmarks/real_peers_diagnosis.py: the cold-repeats table (which requests of a real-peers
phase brought their document first, by the samples' labels, and how much the engine served
from cache), the predicted-reuse table (the gateway's expectation against the engine's), and
its one-line error without input."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from cachepilot.lab.real_peers import WORKLOADS
from cachepilot.lab.real_traffic import label, requests

from helpers.paths import BENCHMARKS, load_benchmark


def sample(workload: str, seed: int, router: str, i: int, doc: str, cached: int,
           predicted_hit: bool | None = None) -> dict[str, Any]:
    return {"workload": workload, "seed": seed, "router": router, "request": i,
            "label": doc, "ok": True,
            "ttft_s": 2.0 if cached < 100 else 0.2, "prompt_tokens": 500,
            "cached_tokens": cached, "predicted_hit": predicted_hit}


def test_first_requests_and_repeats_are_told_apart_by_the_drawn_workload(
        capsys: pytest.CaptureFixture[str]) -> None:
    mod = load_benchmark("real_peers_diagnosis")
    reqs = requests(WORKLOADS["hotspot"], 20, 300)  # the study's draw and labels
    docs = [label(r) for r in reqs]
    first = [d not in docs[:i] for i, d in enumerate(docs)]
    assert 0 < sum(first) < 20  # a hotspot phase repeats documents
    # Router "a" serves every repeat warm; CachePilot every repeat cold, each expected to hit;
    # a partial reuse (half the prompt) for one of a's first requests is counted as such.
    samples = [sample("hotspot", 300, "a", i, docs[i],
                      500 if not f else (250 if i == 0 else 0)) for i, f in enumerate(first)]
    samples += [sample("hotspot", 300, "cachepilot", i, docs[i], 0, predicted_hit=not f)
                for i, f in enumerate(first)][::-1]  # in any order: requests are numbered
    counts = mod.cold_repeats(samples)
    n_first, n_rep = sum(first), 20 - sum(first)
    a, cp = counts[("hotspot", "a")], counts[("hotspot", "cachepilot")]
    assert (a[("first", "partial")], a[("first", "cold")], a[("repeat", "warm")]) == (
        1, n_first - 1, n_rep)
    assert (cp[("first", "cold")], cp[("repeat", "cold")], cp["predicted hit"]) == (
        n_first, n_rep, n_rep)
    out = capsys.readouterr().out
    assert f"| hotspot | cachepilot | 20 | {n_first} / 0 / 0 | {n_rep} / 0 / 0 | {n_rep} | 1.00 |" \
        in out
    assert "| hotspot | a | 20 |" in out and "| – |" in out


def test_a_phase_shorter_than_asked_is_counted_by_its_own_labels() -> None:
    """The study asks for 20 requests but sends what the draw's window holds (18 for shared,
    seed 262): every one is counted, firsts by the documents they name, not by a new draw."""
    mod = load_benchmark("real_peers_diagnosis")
    reqs = requests(WORKLOADS["shared"], 20, 262)
    assert len(reqs) == 18
    docs = [label(r) for r in reqs]
    counts = mod.cold_repeats([sample("shared", 262, "cachepilot", i, d, 0)
                               for i, d in enumerate(docs)])
    c = counts[("shared", "cachepilot")]
    assert (c[("first", "cold")], c[("repeat", "cold")]) == (len(set(docs)), 18 - len(set(docs)))


def test_without_logs_or_samples_it_says_so_in_one_line() -> None:
    r = subprocess.run([sys.executable, str(BENCHMARKS / "real_peers_diagnosis.py")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip() == "name the study's --logs directories, or its --samples"


def test_predicted_reuse_is_set_against_the_engines_by_share_of_the_prompt(
        capsys: pytest.CaptureFixture[str]) -> None:
    mod = load_benchmark("real_peers_diagnosis")

    def rec(predicted: int, cached: int | None) -> dict[str, Any]:
        return {"tokens": 500, "predicted_cached_tokens": predicted,
                "outcome": None if cached is None else {"cached_tokens": cached}}

    cells = {"hotspot-300-cachepilot": [rec(0, 10), rec(300, 290), rec(300, 480),
                                        rec(480, 490), rec(480, None)],
             "shared-300-cachepilot": [rec(0, 0)]}
    counts = mod.predicted_reuse(cells)
    assert counts == {("hotspot", "cold", "cold"): 1, ("hotspot", "partial", "partial"): 1,
                      ("hotspot", "partial", "warm"): 1, ("hotspot", "warm", "warm"): 1,
                      ("shared", "cold", "cold"): 1}
    out = capsys.readouterr().out
    assert "| hotspot | partial | 0 | 1 | 1 |" in out
    assert "| shared | cold | 1 | 0 | 0 |" in out and "| shared | warm |" not in out
