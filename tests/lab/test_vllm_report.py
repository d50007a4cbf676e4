"""The vLLM study's scoring and report (lab/vllm_study.py, lab/vllm_report.py) on
hand-made samples: hit prediction counts, the 0.98 bar, the paired TTFT comparison and the
files written."""

import json
from dataclasses import asdict
from pathlib import Path

from cachepilot.lab.output import StudyOutput
from cachepilot.lab.vllm_report import meets, prediction, write_outputs
from cachepilot.lab.vllm_study import Sample, StudyConfig, phase_record


def _samples(seed: int, policy: str, slow: float) -> list[Sample]:
    # (measured, exact, approx): events right every time; approximate with one false hit
    # and one missed hit per phase.
    cases = [(0, 0, 0), (224, 224, 224), (192, 192, 0), (0, 0, 96), (64, 64, 64)]
    return [Sample(policy, seed, f"w{i % 2}", 300, m, e, a,
                   (0.3 if m else 3.0) * slow + 0.01 * i, "exact")
            for i, (m, e, a) in enumerate(cases)]


def test_scores_bar_and_report(tmp_path: Path) -> None:
    cfg = StudyConfig(seeds=(1, 2, 3), requests=5)
    phases, samples = [], []
    for seed in cfg.seeds:
        for policy, slow in (("round_robin", 1.5 + 0.1 * seed), ("cachepilot", 1.0)):
            got = _samples(seed, policy, slow)
            samples += got
            phases.append(phase_record(got, seed, policy, 10.0, (1.0, 1.2)))
    assert phases[0]["events"] == {"precision": 1.0, "recall": 1.0, "tokens_exact": 1.0,
                                   "tp": 3, "fp": 0, "fn": 0}
    assert phases[0]["approximate"]["fp"] == 1 and phases[0]["approximate"]["fn"] == 1
    data = {"config": {**asdict(cfg), "routers": ["round_robin", "cachepilot"],
                       "block_size": 32, "hash_seed": "0"},
            "workloads": {"vllm": {}}, "phases": phases, "samples": [asdict(s) for s in samples],
            "subscribers": {}, "wall_s": 60.0, "loadavg_start": [1.0, 1.0, 1.0],
            "loadavg_end": [2.0, 1.0, 1.0]}
    pred = prediction(data["samples"], ["round_robin", "cachepilot"])
    assert pred["all"]["events"]["pooled"]["tp"] == 18 and meets(pred)
    assert pred["all"]["approximate"]["pooled"]["precision"] == 12 / 18
    assert not meets({"all": pred["all"] | {"events": pred["all"]["approximate"]}})
    hit, miss = pred["cachepilot"]["ttft_predicted_hit"], pred["cachepilot"]["ttft_predicted_miss"]
    assert hit["n"] == 9 and miss["n"] == 6 and hit["p50_s"] < miss["p50_s"]
    write_outputs(data, StudyOutput(tmp_path, "cmd"))
    doc = json.loads((tmp_path / "results.json").read_text())
    vs = doc["stats"]["vllm"]["vs"]["round_robin"]["ttft_p50_s"]
    assert vs["mean"] < 0 and vs["significant"]  # CachePilot faster on every seed
    assert doc["meets_bar"] is True
    text = (tmp_path / "report.md").read_text()
    assert "**met**" in text and "| all | events | 1.000 | 1.000 |" in text
    assert (tmp_path / "vllm_ttft.png").stat().st_size > 10_000
    assert (tmp_path / "vllm_prediction.png").stat().st_size > 10_000
    assert len(json.loads((tmp_path / "samples.json").read_text())) == 30
