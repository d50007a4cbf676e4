"""A do-nothing LoRA adapter for Gemma 3 270M (``python -m cachepilot.tooling.vllm.lora DIR``):
rank 8 on ``q_proj``/``v_proj``, every weight zero, so it generates what the base model does
while vLLM still serves it as an adapter and keys every block hash with it. The tests use it
to check LoRA hashing against the engine; no torch needed (safetensors written directly).
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

# Gemma 3 270M (the prepared folder's config.json): hidden 640, 4 query heads and 1 KV head
# of 256, 18 layers.
HIDDEN, Q_OUT, KV_OUT, LAYERS = 640, 4 * 256, 1 * 256, 18


def write_adapter(out: Path, rank: int = 8, base: str = "gemma-3-270m-hf") -> Path:
    """The adapter folder (``adapter_config.json`` and ``adapter_model.safetensors``)."""
    out.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
              "target_modules": ["q_proj", "v_proj"], "bias": "none",
              "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
              "fan_in_fan_out": False, "inference_mode": True, "modules_to_save": None}
    (out / "adapter_config.json").write_text(json.dumps(config))
    header: dict[str, object] = {}
    offset = 0
    for layer in range(LAYERS):
        for proj, width in (("q_proj", Q_OUT), ("v_proj", KV_OUT)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            for name, shape in ((f"{prefix}.lora_A.weight", [rank, HIDDEN]),
                                (f"{prefix}.lora_B.weight", [width, rank])):
                size = 4 * shape[0] * shape[1]
                header[name] = {"dtype": "F32", "shape": shape,
                                "data_offsets": [offset, offset + size]}
                offset += size
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with (out / "adapter_model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        f.write(bytes(offset))
    return out


if __name__ == "__main__":
    print(write_adapter(Path(sys.argv[1])))
