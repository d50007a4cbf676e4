"""The one writer of a study's folder (cachepilot.lab.output): the command under the report's
title and first in results.json, JSON that numpy values and NaN survive, figures saved and
closed."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import orjson
import pytest

from cachepilot.lab.output import StudyOutput
from cachepilot.lab.plots import plt


def test_report_and_results_carry_the_command(tmp_path: Path) -> None:
    out = StudyOutput(tmp_path / "study", "cachepilot experiment peers --seeds 2")
    name = out.figure(plt.subplots()[0], "a.png")
    assert name == "a.png" and (tmp_path / "study/a.png").stat().st_size > 0
    assert not plt.get_fignums()  # closed
    out.data("samples.json", [{"x": np.float64(1.5)}])
    out.write("# Title\n\nBody.\n", {"mean": np.float64(0.25), "nan": math.nan,
                                      "by_weight": {0.5: 1}, "arr": np.arange(2)})
    report = (tmp_path / "study/report.md").read_text()
    assert report == "# Title\n\n`cachepilot experiment peers --seeds 2`\n\nBody.\n"
    doc = orjson.loads((tmp_path / "study/results.json").read_bytes())
    assert list(doc) == ["command", "mean", "nan", "by_weight", "arr"]
    assert doc["mean"] == 0.25 and doc["nan"] is None and doc["by_weight"] == {"0.5": 1}
    assert doc["arr"] == [0, 1]
    assert orjson.loads((tmp_path / "study/samples.json").read_bytes()) == [{"x": 1.5}]


def test_a_report_without_a_title_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="title"):
        StudyOutput(tmp_path, "cmd").write("no title here", {})
