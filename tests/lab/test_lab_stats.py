"""The studies' statistics: intervals inside the measure's bounds, Holm's adjustment, the
seeds a study runs on."""

from __future__ import annotations

import math

import pytest

from cachepilot.cli.study_options import parse_seeds, seeds_text
from cachepilot.lab.stats import adjust, counts, holm, paired_difference, paired_ratio, t_pvalue


def test_t_pvalues_match_the_tables() -> None:
    assert t_pvalue(2.262, 9) == pytest.approx(0.05, abs=1e-4)
    assert t_pvalue(12.706, 1) == pytest.approx(0.05, abs=1e-4)
    assert t_pvalue(0.0, 5) == pytest.approx(1.0)


def test_a_ratio_interval_cannot_pass_minus_100_percent() -> None:
    """A p90 that is sometimes far lower and once higher: the old interval on the mean
    difference over the mean went below −100 %; the log-ratio one cannot."""
    ours = [0.05, 0.05, 0.06, 0.05, 0.9]
    theirs = [0.6, 0.7, 0.5, 0.65, 0.3]
    r = paired_ratio(ours, theirs)
    assert -1.0 < r["rel_lo"] < r["rel"] < r["rel_hi"]
    assert math.isnan(paired_ratio([0.0, 1.0], [1.0, 1.0])["rel"])  # not a positive measure


def test_a_rate_difference_is_clipped_to_the_possible() -> None:
    d = paired_difference([1.0, 1.0, 0.9], [0.95, 0.5, 0.9])
    assert d["hi"] <= 1.0 - (0.95 + 0.5 + 0.9) / 3 + 1e-12


def test_holm_is_step_down_and_counts_both() -> None:
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    tests = [{"p": 0.001, "mean": -1.0, "significant": True},
             {"p": 0.03, "mean": 1.0, "significant": True},
             {"p": 0.5, "mean": 1.0, "significant": False}]
    adjust(tests)
    c = counts(tests)
    assert c["raw"] == {"win": 1, "loss": 1, "n.s.": 1}
    assert c["holm"] == {"win": 1, "loss": 0, "n.s.": 2}


def test_seeds_are_a_range_a_list_or_a_count() -> None:
    assert parse_seeds("100-109") == tuple(range(100, 110))
    assert parse_seeds("10") == tuple(range(10))
    assert parse_seeds("1,5,9") == (1, 5, 9)
    assert seeds_text(parse_seeds("10")) == "0-9" and seeds_text((1, 5)) == "1,5"
    for bad in ("9-3", "a-b", "0", "1,1"):
        with pytest.raises(ValueError):
            parse_seeds(bad)
