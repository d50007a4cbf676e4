"""The flow-control study's parts: Jain's index over normalised service, the paired statistics,
the simulator driving the core's flow control (and the llm-d model), and the report."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from cachepilot.core.flow.config import FlowConfig
from cachepilot.lab import flow_report
from cachepilot.lab import flow_study as fs
from cachepilot.lab.flow_stats import (
    bootstrap_diff,
    holm,
    jain,
    log_ratio,
    normalised_jain,
    sign_flip_p,
    water_fill,
)
from cachepilot.sim.flow_driver import SimFlow
from cachepilot.sim.simulator import Simulator

SMALL = (fs.Tenant("flood", 0, 3 * 28.0, 2.0, 10.0), fs.Tenant("light-1", 0, 3.0, 0.0, 12.0),
         fs.Tenant("critical", 10, 2.0, 0.0, 12.0), fs.Tenant("batch", -1, 3.0, 0.0, 12.0))


def test_jain_and_water_filling() -> None:
    assert jain([1, 1, 1, 1]) == pytest.approx(1.0)
    assert jain([1, 0, 0, 0]) == pytest.approx(0.25)
    assert water_fill(10.0, {"a": 2.0, "b": 100.0, "c": 100.0}) == {"a": 2.0, "b": 4.0,
                                                                     "c": 4.0}
    # A light tenant served its demand and a flood the rest: perfectly fair, though the
    # flood got a sliver of what it asked for.
    assert normalised_jain({"light": 2.0, "flood": 8.0},
                           {"light": 2.0, "flood": 1000.0}) == pytest.approx(1.0)
    # The flood took the light tenant's share.
    assert normalised_jain({"light": 0.5, "flood": 9.5}, {"light": 2.0, "flood": 1000.0}) < 0.8


def test_paired_statistics() -> None:
    assert sign_flip_p([1.0, 2.0, 3.0]) == pytest.approx(2 / 8)
    assert sign_flip_p([1.0, -1.0]) == pytest.approx(1.0)
    r = log_ratio([1.0, 2.0, 4.0], [2.0, 4.0, 8.0])
    assert r["ratio"] == pytest.approx(0.5) and r["lo"] == pytest.approx(0.5)
    d = bootstrap_diff([0.9, 0.95, 1.0], [0.5, 0.6, 0.7])
    assert d["lo"] <= d["diff"] <= d["hi"] and d["diff"] == pytest.approx(0.35)
    assert holm({"a": 0.001, "b": 0.02, "c": 0.04}) == {"a": True, "b": True, "c": True}
    assert holm({"a": 0.001, "b": 0.03, "c": 0.04}) == {"a": True, "b": False, "c": False}


def test_flow_control_in_the_simulator_shields_a_light_tenant() -> None:
    wl = fs.mix(7, SMALL)
    base = replace(fs.BASE, workers=2)
    runs = {name: fs.measure(Simulator(replace(base, flow=flow)).run(wl)) for name, flow in (
        ("ours", SimFlow("ours", FlowConfig(ttl_s=5.0))),
        ("fcfs", SimFlow("fcfs", FlowConfig(fairness="fcfs", ttl_s=5.0, holder_wait_ms=0))),
        ("llm-d", fs.SCHEMES["llm-d"]))}
    ours, fcfs = runs["ours"], runs["fcfs"]
    assert ours["tenants"]["light-1"]["refused"] == {}
    assert ours["light_p99_s"] < fcfs["light_p99_s"]
    assert ours["tenants"]["batch"]["refused"].get("flow_sheddable", 0) > 0
    assert sum(ours["tenants"]["flood"]["refused"].values()) > 0
    assert ours["tenants"]["critical"]["ttft_p99_s"] < fcfs["tenants"]["flood"]["ttft_p50_s"]
    assert math.isfinite(ours["jain"]) and ours["jain"] > fcfs["jain"]
    # llm-d holds the sheddable band like any other (no early shed).
    assert "flow_sheddable" not in runs["llm-d"]["refused"]


def test_the_report_judges_the_criteria() -> None:
    rows = []
    for seed in range(4):
        for scheme, p99, j, hit in (("ours", 1.0, 0.99, 0.90), ("vtc", 2.0, 0.99, 0.80),
                                    ("fcfs", 9.0, 0.80, 0.89), ("reject", 9.5, 0.7, 0.88)):
            rows.append({"scheme": scheme, "seed": seed, "light_p99_s": p99 + 0.01 * seed,
                         "light_p50_s": 0.1, "light_refused": 0, "jain": j, "jain_min": j,
                         "token_hit_rate": hit, "saturated_tokens_s": 1000.0,
                         "tenants": {}, "refused": {}})
    text = flow_report.report(rows, ["ours", "vtc", "fcfs", "reject"], (0, 1, 2, 3),
                              1.0)
    assert "Jain's index ≥ 0.95: mean 0.990" in text and "**met**" in text
    # Four seeds cannot reach significance after Holm (the smallest p is 2/16).
    assert "Holm: **not met**" in text
