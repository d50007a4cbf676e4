"""Whether a binary a test runs is there (tests that need one skip, with the reason,
without it)."""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from pathlib import Path

from cachepilot.tooling.stack import envoy_binary


def have_command(name: str) -> bool:
    """Installed beside the interpreter (CI runs .venv/bin/python without activating the
    venv, so its bin/ is not on PATH) or on PATH."""
    return (Path(sys.executable).parent / name).exists() or shutil.which(name) is not None


def have_envoy() -> bool:
    return have_command("envoy")


@functools.cache
def envoy_problem() -> str | None:
    """Why Envoy cannot run here (None: it can)."""
    try:
        out = subprocess.run([envoy_binary(), "--version"], capture_output=True, timeout=30)
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        return f"envoy cannot run: {exc}"
    return None if out.returncode == 0 else f"envoy --version failed: {out.stderr[-300:]!r}"
