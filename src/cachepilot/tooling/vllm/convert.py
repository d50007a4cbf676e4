"""GGUF → Hugging Face folder, run by the vLLM venv's interpreter (torch, transformers,
gguf, accelerate live there, not in CachePilot's venv):

    .venv-vllm/bin/python convert.py MODEL.gguf OUT_DIR

vLLM on CPU cannot serve a GGUF, so the weights are dequantised to bfloat16 and saved as
safetensors. The tokenizer read from a GGUF drops ``<bos>``: its post-processor is rebuilt
to prepend it, since Gemma's output is garbage without it, and vLLM (hence the block hashes)
tokenises completions prompts with it. Imports nothing from CachePilot.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def step(msg: str, t0: float) -> None:
    print(f"[prepare-model] {msg} ({time.monotonic() - t0:.0f} s)", flush=True)


def convert(gguf: Path, out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, processors
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    t0 = time.monotonic()
    kw = {"gguf_file": gguf.name}
    tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    step("tokenizer read", t0)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, **kw, dtype=torch.bfloat16,
        quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True))
    step("weights dequantised", t0)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    step("saved", t0)

    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)  # the saved weights are plain bfloat16
    cfg_path.write_text(json.dumps(cfg, indent=2))

    tj = out / "tokenizer.json"
    fast = Tokenizer.from_file(str(tj))
    bos = tok.bos_token or "<bos>"
    bos_id = fast.token_to_id(bos)
    if bos_id is None:
        raise SystemExit(f"no {bos!r} in the vocabulary")
    fast.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B:1", special_tokens=[(bos, bos_id)])
    fast.save(str(tj))
    tcfg_path = out / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text()) if tcfg_path.exists() else {}
    tcfg.update(add_bos_token=True, bos_token=bos)
    tcfg_path.write_text(json.dumps(tcfg, indent=2))
    ids = fast.encode("Hello").ids
    if ids[:1] != [bos_id]:
        raise SystemExit(f"BOS fix failed: 'Hello' -> {ids}")
    step(f"tokenizer fixed: 'Hello' -> {ids}", t0)


if __name__ == "__main__":
    convert(Path(sys.argv[1]).absolute(), Path(sys.argv[2]).absolute())
