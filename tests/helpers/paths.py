"""Where things are, wherever a test module sits: the repository's root and tests/data/."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
