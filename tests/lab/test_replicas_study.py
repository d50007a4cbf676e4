"""The replicas study's analysis: paired against one replica, and the issue's bar."""

from pathlib import Path

from cachepilot.lab import replicas as rs
from cachepilot.lab.output import StudyOutput


def fake(hit_loss: float, p90_gain: float) -> dict:
    results = []
    for seed in range(4):
        runs = {}
        for case, (n, _, delay) in rs.CASES.items():
            alone = n > 1 and delay is None
            hit = 0.9 - (0.05 if alone else hit_loss * (n > 1)) + 0.001 * seed
            p90 = 0.05 * (1 + (1.0 if alone else p90_gain * (n > 1))) + 0.001 * seed
            runs[case] = {"ttft_p50_s": 0.03, "ttft_p90_s": p90, "ttft_p99_s": 0.5,
                          "token_hit_rate": hit, "imbalance_assigned": 1.1, "requests": 100}
        results.append({"workload": "shared", "seed": seed, "runs": runs})
    return {"results": results, "seeds": [0, 1, 2, 3], "wall_s": 1.0, "workloads": ["shared"]}


def test_the_bar_is_two_points_of_hit_rate_and_ten_percent_of_p90(tmp_path: Path) -> None:
    assert rs.meets(rs.analyse(fake(0.01, 0.05))["shared"])
    assert not rs.meets(rs.analyse(fake(0.03, 0.05))["shared"])
    assert not rs.meets(rs.analyse(fake(0.01, 0.2))["shared"])
    output = StudyOutput(tmp_path, "cachepilot experiment replicas")
    stats = rs.write_outputs(fake(0.01, 0.05), output)
    report = (tmp_path / "report.md").read_text()
    assert "4 synced replicas meets the bar" in report and "| 8 alone |" in report
    assert (tmp_path / "replicas.png").stat().st_size > 0
    assert stats["shared"]["4 alone"]["vs_one"]["token_hit_rate"]["mean"] < -0.04
