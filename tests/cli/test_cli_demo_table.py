"""The demo's table, printed and saved as an SVG (`cachepilot demo --svg`), from a summary of
the shape `run_demo` returns (the stack itself runs in tests/tooling and the CI's demo)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from cachepilot.cli.demo import _table
from cachepilot.cli.options import save_svg


def _phase(p50: float, hits: float) -> dict[str, object]:
    return {"requests": 253, "errors": 0, "ttft_p50_s": p50, "ttft_p99_s": 4 * p50,
            "throughput_rps": 8.37, "token_hit_rate": hits, "imbalance": 1.04,
            "per_worker": {"a": 120, "b": 133}}


def test_the_demo_table_is_saved_as_svg(tmp_path: Path) -> None:
    out = {"round_robin": _phase(0.430, 0.30),
           "cachepilot": {**_phase(0.034, 0.83), "predictor_rel_error_p50": 0.14,
                          "predictor_rel_error_p90": 0.46, "predictor_observations": 253}}
    console = Console(width=120, record=True)
    _table(out, console)
    text = console.export_text(clear=False)
    assert "430" in text and "83%" in text and "8% of round robin's" in text
    assert "median |error| 14%" in text
    path = tmp_path / "demo.svg"
    save_svg(console, str(path), "cachepilot demo")
    svg = path.read_text()
    assert svg.lstrip().startswith("<svg") and "round_robin" in svg
    assert "cachepilot&#160;demo" in svg
    save_svg(console, None, "nothing")  # no path: nothing written, no error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.svg"]
