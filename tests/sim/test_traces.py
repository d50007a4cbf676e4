"""Traces a user brings: Mooncake's format and ours, detected; bad files end in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from cachepilot.cli import main
from cachepilot.core.fingerprint import BlockConfig
from cachepilot.sim import WorkloadSpec, generate
from cachepilot.sim.traces import TraceFormatError, detect_format, read_mooncake
from cachepilot.sim.workloads import write_trace

MOONCAKE_ROWS = [
    # Two turns of one conversation (the second extends the first), one unrelated request.
    {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 2]},
    {"timestamp": 500, "input_length": 600, "output_length": 5, "hash_ids": [7, 8]},
    {"timestamp": 2000, "input_length": 2000, "output_length": 20, "hash_ids": [0, 1, 2, 3]},
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_mooncake_blocks_share_exactly_what_the_trace_says(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "mc.jsonl", MOONCAKE_ROWS)
    assert detect_format(path) == "mooncake"
    a, b, c = read_mooncake(path, model="m", block=BlockConfig(16))
    assert [r.arrival_s for r in (a, b, c)] == [0.0, 0.5, 2.0]
    assert a.fingerprint.tokens == 1100 and a.fingerprint.blocks == 1100 // 16  # full only
    # The second turn shares the first turn's whole first 2 trace blocks (64 sub-blocks) and
    # the full sub-blocks of its third (1100 − 1024 = 76 tokens → 4 of them), nothing more.
    shared = 0
    for x, y in zip(a.fingerprint.hashes, c.fingerprint.hashes, strict=False):
        if x != y:
            break
        shared += 1
    assert shared == a.fingerprint.blocks == 68
    assert not set(b.fingerprint.hashes) & set(a.fingerprint.hashes)
    # A different model never shares blocks.
    other = read_mooncake(path, model="n", block=BlockConfig(16))[0]
    assert other.fingerprint.hashes[0] != a.fingerprint.hashes[0]


def test_a_mooncake_trace_is_a_workload_sped_up_and_sampled(tmp_path: Path) -> None:
    rows = [{"timestamp": 100 * i, "input_length": 700, "output_length": 3,
             "hash_ids": [i % 40, 1000 + i]} for i in range(400)]
    path = write_jsonl(tmp_path / "mc.jsonl", rows)
    whole = generate(WorkloadSpec("trace", path=str(path), rate_scale=2.0), 0)
    assert len(whole) == 400 and whole.requests[-1].arrival == pytest.approx(39.9 / 2)
    halves = [generate(WorkloadSpec("trace", path=str(path), sample=0.5), s) for s in (1, 2)]
    for h in halves:
        assert 100 < len(h) < 300
        groups = {r.fp.hashes[0] for r in h.requests}
        # Whole prefix groups are kept or dropped together.
        assert all(sum(r.fp.hashes[0] == g for r in h.requests) == 10 for g in groups)
    assert {r.fp.hashes[0] for r in halves[0].requests} != \
        {r.fp.hashes[0] for r in halves[1].requests}


def test_our_own_trace_format_round_trips(tmp_path: Path) -> None:
    wl = generate(WorkloadSpec("hotspot", duration=3.0), 1)
    write_trace(wl.requests, tmp_path / "t.jsonl")
    assert detect_format(tmp_path / "t.jsonl") == "cachepilot"
    back = generate(WorkloadSpec("trace", path=str(tmp_path / "t.jsonl")), 0)
    assert [r.fp for r in back.requests] == [r.fp for r in wl.requests]


@pytest.mark.parametrize(("content", "says"), [
    ("timestamp,input_length\n0,10\n", "not a JSON object"),
    ('{"when": 1, "tokens": [1, 2]}\n', "in no known trace format"),
    ("", "empty trace"),
    ('{"timestamp": 0, "input_length": 5000, "hash_ids": [1]}\n', "cannot hold"),
])
def test_a_file_in_no_known_format_is_one_clear_error(tmp_path: Path, content: str,
                                                        says: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(TraceFormatError, match=says):
        generate(WorkloadSpec("trace", path=str(path)), 0)
    res = CliRunner().invoke(main, ["simulate", "--workload", "trace", "--trace", str(path)])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert lines[-1].startswith("Error:") and says in lines[-1]
    assert "Traceback" not in res.output


def test_simulate_a_mooncake_trace_from_the_command_line(tmp_path: Path) -> None:
    rows = [{"timestamp": 50 * i, "input_length": 1500 + 2 * i, "output_length": 8,
             "hash_ids": [i % 12, 100 + i % 12, 500 + i, 900 + i]} for i in range(240)]
    path = write_jsonl(tmp_path / "mc.jsonl", rows)
    res = CliRunner().invoke(main, ["simulate", "--workload", "trace", "--trace", str(path),
                                    "--workers", "4", "--json"])
    assert res.exit_code == 0, res.output
    s = json.loads(res.output)
    assert s["requests"] == s["completed"] == 240
    assert s["token_hit_rate"] > 0.3  # the 12 shared 1k-token prefixes are reused
    for key in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "predictor_rel_error_p50"):
        assert s[key] >= 0
    too_small = CliRunner().invoke(main, ["simulate", "--workload", "trace", "--trace",
                                          str(path), "--kv-blocks", "64"])
    assert too_small.exit_code == 2 and "raise --kv-blocks" in too_small.output
