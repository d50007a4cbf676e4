"""MkDocs hook: the reference pages generated from the code (cachepilot.docgen), added to the
build as pages of their own, so they cannot drift. Also tidies the Sphinx roles the code's
docstrings use (:class:`~a.b.C` → `C`) in the pages mkdocstrings renders."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
# The repository's own code, whatever is installed (a worktree, a fresh clone).
sys.path.insert(0, str(ROOT / "src"))

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):(?=<code>)")
_TILDE = re.compile(r"<code>~(?:[\w]+\.)*([\w]+)</code>")


def on_files(files: Files, config: Any) -> Files:
    from cachepilot.docgen import render

    for path, text in render(ROOT).items():
        files.append(File.generated(config, path, content=text))
    return files


def on_page_content(html: str, page: Any, config: Any, files: Files) -> str:
    if ":" not in html:
        return html
    return _TILDE.sub(r"<code>\1</code>", _ROLE.sub("", html))
