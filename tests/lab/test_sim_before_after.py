"""benchmarks/sim_before_after.py: the default policy's cells of the peers study, and their
paired comparison (the figures docs/real-model.md gives for the slot progress)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers.paths import BENCHMARKS, load_benchmark

SCRIPT = BENCHMARKS / "sim_before_after.py"


def test_a_tree_against_itself_changes_nothing_and_a_change_shows() -> None:
    mod = load_benchmark("sim_before_after")
    before = mod.run(["llama_shared"], (0, 1, 2), None)
    assert sorted(before) == ["llama_shared/0", "llama_shared/1", "llama_shared/2"]
    assert mod.run(["llama_shared"], (0, 1, 2), None) == before  # deterministic by seed
    same = mod.compare(before, before)
    assert same[2].startswith("| llama_shared | 3 | +0.0% [+0.0%, +0.0%]")
    slower = {k: {m: v * 1.2 if m.startswith("ttft") else v for m, v in r.items()}
              for k, r in before.items()}
    assert "| +20.0% [+20.0%, +20.0%] **" in mod.compare(slower, before)[2]


def test_bad_arguments_get_one_line_and_exit_2(tmp_path: Path) -> None:
    for args in (["--seeds", "9-1"], ["--workloads", "nope"]):
        r = subprocess.run([sys.executable, str(SCRIPT), *args, "--out",
                            str(tmp_path / "x.json")], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
