"""Check the model of what a llama-server keeps (:class:`cachepilot.core.slot_memory.SlotMemory`)
against the engine's own cached-token counts, on a random sequence of requests.

One real worker (``-np 1``, a given ``--cache-ram``) gets requests for a few documents in a
random order, each document followed by its own question, one at a time. For each, the
engine says how many prompt tokens it reused (``timings.cache_n``), and two models predict
it before it is sent:

- ``tokens``: the model run on the engine's own token ids (``/tokenize``), one "block" per
  token: whether the rules are the engine's.
- ``gateway``: the gateway's directory as it runs (16-token blocks of the estimated tokens
  of the text, as its fingerprints are), in slot mode with the cache the gateway is told:
  the prediction that routing uses.

With ``--api chat`` the same sequence goes to ``/v1/chat/completions`` as the real-peers
study sends it (the document in the system message, the question in the user's), and the
gateway's prediction is made as the router makes it: the request parsed from its body,
the directory told where its last message starts. The token-level model is for
completions only (it would need the engine's rendered template).

``python -m cachepilot.tooling.llamacpp.cache_check`` prints the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from cachepilot.core.directory import PrefixDirectory
from cachepilot.core.fingerprint import BlockConfig, fingerprint
from cachepilot.core.request import CHAT_PATH, parse_openai_body
from cachepilot.core.slot_memory import SlotConfig, SlotMemory
from cachepilot.sim.prompt_text import words
from cachepilot.tooling.llamacpp.calibration import calibrate
from cachepilot.tooling.llamacpp.worker import PROMPT_STATE_MIB, LlamaWorkerSpec, model_path
from cachepilot.tooling.procs import Processes
from cachepilot.tooling.stack import free_port


@dataclass(frozen=True)
class CheckConfig:
    seed: int = 100
    requests: int = 24
    docs: int = 6
    doc_words: tuple[int, int] = (150, 700)  # ~170-640 tokens: in and past the 512 window
    question_words: int = 12
    cache_ram_mib: int = 8192
    ctx: int = 2048
    swa_tokens: int = 512  # Gemma 3's sliding window: a shorter match is not reused
    ubatch: int = 256  # the worker's -ub: where its context checkpoints fall
    block_size: int = 16
    api: str = "completions"  # or "chat"


@dataclass
class Sample:
    index: int
    doc: int
    prompt_tokens: int
    engine: int  # timings.cache_n (chat: usage.prompt_tokens_details.cached_tokens)
    tokens: int  # the token-level model's prediction (chat: -1, not made)
    gateway: int  # the directory's, in tokens (blocks x block size, capped)


def _post(url: str, body: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
    req = urllib.request.Request(url, orjson.dumps(body), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return orjson.loads(resp.read())


def prompts(cfg: CheckConfig) -> list[tuple[int, str, str]]:
    """(document, its text, the question) in a random order: every document once early,
    then at random."""
    rng = random.Random(cfg.seed)
    texts = [f"Document {d}. " + words(rng, rng.randint(*cfg.doc_words))
             for d in range(cfg.docs)]
    order = list(range(cfg.docs)) + [rng.randrange(cfg.docs)
                                     for _ in range(max(0, cfg.requests - cfg.docs))]
    rng.shuffle(order)
    return [(d, texts[d], f"Question {i}: {words(rng, cfg.question_words)}")
            for i, d in enumerate(order)]


def _cache_prompts(cfg: CheckConfig) -> int:
    return 0 if cfg.cache_ram_mib == 0 else max(1, int(cfg.cache_ram_mib // PROMPT_STATE_MIB))


def run_check(cfg: CheckConfig, address: str, chars_per_token: float) -> list[Sample]:
    """Send the sequence to the worker at ``address`` (fresh: nothing cached), one at a
    time, predicting each answer's cached tokens first."""
    entries = _cache_prompts(cfg)
    exact = SlotMemory(SlotConfig(slots=1, slot_blocks=cfg.ctx, entries=entries,
                                  min_reuse=cfg.swa_tokens, batch=cfg.ubatch,
                                  checkpoint_offsets=(cfg.ubatch, 4), checkpoint_back=1))
    block = BlockConfig(cfg.block_size, chars_per_token)
    directory = PrefixDirectory()
    directory.add_worker("w")
    directory.set_slots("w", 1, cfg.ctx // cfg.block_size, entries=entries,
                        min_reuse=cfg.swa_tokens // cfg.block_size,
                        batch=cfg.ubatch // cfg.block_size)
    out = []
    for i, (doc, doc_text, question) in enumerate(prompts(cfg)):
        if cfg.api == "chat":
            out.append(_chat_sample(cfg, address, directory, block, i, doc, doc_text,
                                    question))
            continue
        text = f"{doc_text}\n{question}"
        ids = _post(f"http://{address}/tokenize", {"content": text, "add_special": True}
                    )["tokens"]
        fp = fingerprint("m", block, text=text)
        predicted = exact.reuse(ids)
        blocks = directory.match(fp.hashes, ["w"])["w"]
        res = _post(f"http://{address}/completion", {
            "prompt": text, "n_predict": 1, "cache_prompt": True, "temperature": 0})
        placed = exact.place(ids)  # (the slot also holds the one generated token: ignored)
        exact.release(placed.slot)
        directory.insert("w", fp.hashes)
        n = len(ids)
        out.append(Sample(i, doc, n, int(res["timings"]["cache_n"]),
                          min(predicted, n - 1), min(blocks * cfg.block_size, n - 1)))
    return out


def _chat_sample(cfg: CheckConfig, address: str, directory: PrefixDirectory,
                 block: BlockConfig, i: int, doc: int, doc_text: str,
                 question: str) -> Sample:
    """One chat request: the gateway's prediction as the router makes it (the body parsed,
    the directory told where the last message starts), then the engine's count."""
    body = {"model": "m", "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": doc_text},
                         {"role": "user", "content": question}]}
    req = parse_openai_body(CHAT_PATH, orjson.dumps(body))
    fp = fingerprint("m", block, text=req.prompt)
    blocks = directory.match(fp.hashes, ["w"])["w"]
    usage = _post(f"http://{address}{CHAT_PATH}", body)["usage"]
    directory.insert("w", fp.hashes, turn=req.blocks_before_last_message(block.block_bytes))
    n = int(usage["prompt_tokens"])
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return Sample(i, doc, n, cached, -1, min(blocks * cfg.block_size, n - 1))


HIT = 16  # tokens: a reuse shorter than a block (the "<bos>Document" head) is no hit


def score(samples: list[Sample]) -> dict[str, Any]:
    """Agreement with the engine: hit/miss (a hit: at least :data:`HIT` tokens reused),
    and the cached tokens' absolute error."""
    def one(key: str) -> dict[str, Any]:
        pred = [getattr(s, key) for s in samples]
        hits = sum((p >= HIT) == (s.engine >= HIT)
                   for p, s in zip(pred, samples, strict=True))
        err = [abs(p - s.engine) for p, s in zip(pred, samples, strict=True)]
        return {"hit_agreement": hits / len(samples),
                "tokens_mean_abs_error": sum(err) / len(err),
                "tokens_within_16": sum(e <= 16 for e in err) / len(err),
                "predicted_cached": sum(pred)}
    out = {"requests": len(samples), "engine_cached": sum(s.engine for s in samples),
           "prompt_tokens": sum(s.prompt_tokens for s in samples),
           "engine_hits": sum(s.engine >= HIT for s in samples), "gateway": one("gateway")}
    if all(s.tokens >= 0 for s in samples):  # the token-level model ran (completions)
        out["tokens"] = one("tokens")
    return out


def check(cfg: CheckConfig, log_dir: str | None = None) -> dict[str, Any]:
    """One fresh worker, the sequence, the scores; every sample too."""
    procs = Processes(Path(log_dir or tempfile.mkdtemp(prefix="cachepilot-cache-check-")))
    spec = LlamaWorkerSpec(threads=2, ctx_per_slot=cfg.ctx, cache_ram_mib=cfg.cache_ram_mib)
    port = free_port()
    try:
        procs.spawn("llama", spec.args(model_path(), port))
        procs.wait_ready([f"http://127.0.0.1:{port}/health"], 120.0, poll_s=0.2)
        # Measured, not assumed: the gateway's blocks use the same estimate.
        cal = calibrate(f"127.0.0.1:{port}")
        # The calibration prompt is in the cache now: a fresh worker for the sequence.
        procs.stop()
        procs = Processes(procs.log_dir)
        procs.spawn("llama", spec.args(model_path(), port))
        procs.wait_ready([f"http://127.0.0.1:{port}/health"], 120.0, poll_s=0.2)
        samples = run_check(cfg, f"127.0.0.1:{port}", cal.chars_per_token)
    finally:
        procs.stop()
    return {"config": asdict(cfg), "chars_per_token": round(cal.chars_per_token, 3),
            **score(samples), "samples": [asdict(s) for s in samples]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=CheckConfig.seed)
    ap.add_argument("--requests", type=int, default=CheckConfig.requests)
    ap.add_argument("--cache-ram", type=int, default=CheckConfig.cache_ram_mib)
    ap.add_argument("--api", choices=("completions", "chat"), default=CheckConfig.api)
    ap.add_argument("--samples", action="store_true", help="print every request too")
    args = ap.parse_args(argv)
    out = check(CheckConfig(seed=args.seed, requests=args.requests,
                            cache_ram_mib=args.cache_ram, api=args.api))
    if not args.samples:
        out.pop("samples")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
