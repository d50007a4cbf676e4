"""Measure a vLLM worker once (prefill and decode speed, bytes per token) and turn it into
the gateway's cost model: the defaults describe a GPU, and a CPU worker prefills some thirty
times slower, so without this the predictor would start seconds off on every worker."""

from __future__ import annotations

import random
import time
import urllib.request
from typing import Any

import orjson

from cachepilot.sim.prompt_text import words
from cachepilot.tooling.llamacpp.calibration import Calibration


def _complete(address: str, model: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    req = urllib.request.Request(f"http://{address}/v1/completions", orjson.dumps(body),
                                 {"content-type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300.0) as resp:
        out: Any = orjson.loads(resp.read())
    return (time.perf_counter() - t0) * 1000.0, int(out["usage"]["prompt_tokens"])


def calibrate_vllm(address: str, model: str, n_words: int = 300, seed: int = 99
                   ) -> Calibration:
    """Two cold completions of different text on one worker: one token (prefill), then
    nine (prefill and eight decode steps)."""
    rng = random.Random(seed)
    a = "calibration " + words(rng, n_words)
    b = "calibration " + words(rng, n_words)
    one, tokens = _complete(address, model, a, 1)
    nine, _ = _complete(address, model, b, 9)
    return Calibration(prefill_ms_per_token=one / max(1, tokens),
                       decode_ms_per_token=max(0.1, (nine - one) / 8),
                       chars_per_token=len(a.encode()) / max(1, tokens))


def vllm_cost(cal: Calibration) -> str:
    """``--cost`` for a gateway in front of CPU vLLM workers: the measured prefill, a
    decode step as the fixed cost, and metrics judged stale after 15 s, not 5 (a scrape
    can wait behind a long prefill step)."""
    return (f"prefill_ms_per_token={cal.prefill_ms_per_token:.4f},"
            f"base_ttft_ms={cal.decode_ms_per_token:.2f},stale_after_s=15")
