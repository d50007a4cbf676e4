"""``python -m cachepilot.docgen OUT``: write the generated reference pages under OUT."""

from __future__ import annotations

import sys
from pathlib import Path

from cachepilot.docgen import render

if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "out/docgen")
    for path, text in render(Path.cwd()).items():
        target = out / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        print(target)
