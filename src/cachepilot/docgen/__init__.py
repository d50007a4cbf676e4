"""The docs site's reference pages, generated from the code when the site is built.

``docs/hooks/reference.py`` (a MkDocs hook) adds every page in :data:`PAGES` to the build,
so the CLI, CRD, Helm values, metrics, HTTP and decision-record references cannot drift
from the code; ``python -m cachepilot.docgen OUT`` writes them to a folder to read them
without MkDocs. ``tests/docgen/test_docgen.py`` checks that they cover every command, CRD field,
Helm value, metric, header and record field. This package sits on top of the layers: it
reads the CLI, the operator's CRD, the gateway's registries and the records' schema.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from cachepilot.docgen import cli, crd, helm, http, metrics, records

# Site path (under docs/) → the function that renders it from the repository root.
PAGES: dict[str, Callable[[Path], str]] = {
    cli.PATH: cli.page,
    crd.PATH: crd.page,
    helm.PATH: helm.page,
    metrics.PATH: metrics.page,
    http.PATH: http.page,
    records.PATH: records.page,
}


def render(root: Path) -> dict[str, str]:
    """Every generated page, by its path under docs/."""
    return {path: page(root) for path, page in PAGES.items()}
