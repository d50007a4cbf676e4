"""Measure a llama-server worker once at start (prefill and decode speed, chars per token)
and turn it into the gateway's cost model."""

from __future__ import annotations

import random
import urllib.request
from dataclasses import dataclass
from typing import Any

import orjson

from cachepilot.core.cost import CostModel
from cachepilot.sim.prompt_text import words


@dataclass(frozen=True)
class Calibration:
    """Measured on the workers at start: what the gateway's cost model and byte blocks need."""

    prefill_ms_per_token: float  # cold prompt, one worker alone
    decode_ms_per_token: float
    chars_per_token: float  # UTF-8 bytes per token of the calibration text

    def cost_model(self, max_tokens: int = 8) -> CostModel:
        """CPU terms in ms. A deferred request waits for a slot: about one request's decode
        plus a prompt's prefill; a running one shares the thread for its remaining decode.
        Scrapes can wait for a prompt batch, so staleness is judged over 15 s, not 5."""
        return CostModel(prefill_ms_per_token=self.prefill_ms_per_token,
                         base_ttft_ms=self.decode_ms_per_token,
                         queue_ms_per_running=self.decode_ms_per_token * max_tokens / 2,
                         queue_ms_per_waiting=self.decode_ms_per_token * max_tokens
                         + 300 * self.prefill_ms_per_token,
                         stale_after_s=15.0)


def cost_args(cost: CostModel) -> str:
    """``--cost`` for ``cachepilot gateway``: the parameters that differ from the defaults."""
    default = CostModel().to_dict()
    return ",".join(f"{k}={v!r}" for k, v in cost.to_dict().items() if v != default[k])


def _post(url: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    req = urllib.request.Request(url, orjson.dumps(body), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return orjson.loads(resp.read())


def calibrate(address: str, n_words: int = 300, seed: int = 99) -> Calibration:
    """One cold /completion on one worker: prefill and decode speed, and chars per token."""
    text = "calibration " + words(random.Random(seed), n_words)
    tokens = _post(f"http://{address}/tokenize", {"content": text})["tokens"]
    out = _post(f"http://{address}/completion",
                {"prompt": text, "n_predict": 8, "cache_prompt": True, "ignore_eos": True})
    t = out["timings"]
    return Calibration(prefill_ms_per_token=t["prompt_ms"] / max(1, t["prompt_n"]),
                       decode_ms_per_token=t["predicted_ms"] / max(1, t["predicted_n"]),
                       chars_per_token=len(text.encode()) / max(1, len(tokens)))
