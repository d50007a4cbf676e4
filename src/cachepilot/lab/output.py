"""One writer for every study's folder: ``report.md``, ``results.json``, the PNG plots, any
raw data (``samples.json``), and the command that reproduces the study, in the report under
its title and in the JSON.

Each study used to write its own files its own way (``json`` here, ``orjson`` there, the
command in some reports only); a reader of ``docs/results/*`` now finds the same layout in
every folder, and a study says what to write, not how.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from matplotlib.figure import Figure

REPORT = "report.md"
RESULTS = "results.json"
# numpy scalars and arrays as numbers; NaN and infinities as null; float keys as strings.
_JSON = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS


@dataclass(frozen=True)
class StudyOutput:
    """A study's output folder (created on first use) and the command that reproduces it."""

    out: Path
    command: str

    def _dir(self) -> Path:
        self.out.mkdir(parents=True, exist_ok=True)
        return self.out

    def figure(self, fig: Figure, name: str, dpi: int = 110) -> str:
        """Save ``fig`` as PNG ``name`` and close it; the name, for the report's link."""
        import matplotlib.pyplot as plt

        fig.savefig(self._dir() / name, dpi=dpi)
        plt.close(fig)
        return name

    def data(self, name: str, doc: Any, indent: bool = False) -> Path:
        """Raw data beside the results (one row per request: compact unless ``indent``)."""
        path = self._dir() / name
        path.write_bytes(orjson.dumps(doc, option=_JSON | (orjson.OPT_INDENT_2 if indent
                                                            else 0)))
        return path

    def write(self, report: str, results: dict[str, Any]) -> None:
        """``report.md`` (the command under its title) and ``results.json`` (the command
        first, then ``results``)."""
        title, sep, rest = report.partition("\n\n")
        if not title.startswith("# ") or not sep:
            raise ValueError("a study's report starts with its '# title' and a blank line")
        (self._dir() / REPORT).write_text(f"{title}\n\n`{self.command}`\n\n{rest}")
        self.data(RESULTS, {"command": self.command, **results}, indent=True)


def seeds_phrase(seeds: list[int]) -> str:
    """How a report names its seeds: ``seeds 100–109`` (consecutive) or ``seeds 1, 5, 9``."""
    if len(seeds) > 1 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"seeds {seeds[0]}–{seeds[-1]}"
    return "seeds " + ", ".join(map(str, seeds))
