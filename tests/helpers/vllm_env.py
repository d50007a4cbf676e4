"""What the real-vLLM tests share: where the vLLM venv is, whether a missing vLLM fails
(CI) or skips, and the long shared prompt whose blocks a second request reuses."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cachepilot.tooling.vllm import install, model

from helpers.paths import ROOT

VENV = Path(os.environ.get("CACHEPILOT_VLLM_VENV", ROOT / ".venv-vllm"))
REQUIRE = os.environ.get("CACHEPILOT_REQUIRE_VLLM") == "1"
SHARED = ("You are a careful assistant for a shipping company. Answer in one short sentence. "
          "Policies: parcels under two kilograms ship for a flat fee; larger parcels are "
          "priced by weight and distance; fragile items need the red label; returns are "
          "free within thirty days when the original label is kept. ") * 4


def prepared_model() -> Path:
    """The prepared model folder; without the venv or the model, skip (fail in CI, where a
    missing model is prepared first)."""
    if not install.installed(VENV):
        if REQUIRE:
            pytest.fail(f"no usable vLLM venv at {VENV} (make vllm-venv)")
        pytest.skip(f"no vLLM venv at {VENV}: make vllm-venv")
    found = model.prepared()
    if found is None:
        if REQUIRE:
            return model.prepare(VENV)
        pytest.skip("model not prepared: make vllm-model")
    return found
