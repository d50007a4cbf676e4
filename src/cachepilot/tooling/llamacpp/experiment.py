"""The real-model study: the same requests through a fresh llama.cpp stack per policy, each
answer joined with the gateway's prediction; figures, samples and a plot."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from cachepilot.tooling.llamacpp.plots import plot
from cachepilot.tooling.llamacpp.stack import LlamaStack
from cachepilot.tooling.llamacpp.worker import LlamaWorkerSpec
from cachepilot.tooling.llamacpp.workload import RealWorkload


@dataclass
class Sample:
    """One request: what the client measured, joined with the gateway's prediction."""

    doc: str
    ok: bool
    ttft_ms: float | None
    worker: str | None
    decision_id: str | None
    prompt_tokens: int
    cached_tokens: int  # the worker's own count (usage.prompt_tokens_details)
    predicted_hit: bool | None = None
    predicted_cached_tokens: int | None = None
    error: str | None = None

    @property
    def measured_hit(self) -> bool:
        return self.cached_tokens > 0


async def drive(stack: LlamaStack, workload: RealWorkload) -> tuple[list[Sample], float]:
    """Send the workload through Envoy; join each answer with its decision record."""
    import aiohttp
    import numpy as np

    from cachepilot.tooling.loadgen import one_request

    bodies = workload.bodies()
    gaps = np.random.default_rng(workload.seed).exponential(1.0 / workload.rate, len(bodies))
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        start = at = time.perf_counter()
        tasks = []
        for (_, body), gap in zip(bodies, gaps, strict=True):
            at += gap
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            tasks.append(asyncio.create_task(one_request(session, stack.url, body)))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    samples = []
    for (doc, _), r in zip(bodies, results, strict=True):
        s = Sample(doc=doc, ok=r.ok and r.ttft_s is not None,
                   ttft_ms=None if r.ttft_s is None else r.ttft_s * 1000.0, worker=r.worker,
                   decision_id=r.decision_id, prompt_tokens=r.prompt_tokens,
                   cached_tokens=r.cached_tokens, error=r.error)
        rec = await asyncio.to_thread(stack.decision, r.decision_id) if r.decision_id else None
        if rec is not None:
            s.predicted_hit = bool(rec["predicted_hit"])
            s.predicted_cached_tokens = int(rec["predicted_cached_tokens"])
        samples.append(s)
    return samples, wall


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    vs = sorted(values)
    k = (len(vs) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(vs) - 1)
    return round(vs[lo] + (vs[hi] - vs[lo]) * (k - lo), 1)


def summarize(samples: list[Sample], wall_s: float) -> dict[str, Any]:
    """TTFT by predicted hit/miss, and the prediction scored against the worker's count."""
    ok = [s for s in samples if s.ok and s.predicted_hit is not None]

    def ttft(group: list[Sample]) -> dict[str, Any]:
        v = [s.ttft_ms for s in group if s.ttft_ms is not None]
        return {"n": len(v), "p50_ms": _pct(v, 50), "p90_ms": _pct(v, 90),
                "mean_ms": round(sum(v) / len(v), 1) if v else None}

    tp = sum(1 for s in ok if s.predicted_hit and s.measured_hit)
    fp = sum(1 for s in ok if s.predicted_hit and not s.measured_hit)
    fn = sum(1 for s in ok if not s.predicted_hit and s.measured_hit)
    tn = len(ok) - tp - fp - fn
    prompt = sum(s.prompt_tokens for s in ok)
    per_worker: dict[str, int] = {}
    for s in ok:
        per_worker[s.worker or "?"] = per_worker.get(s.worker or "?", 0) + 1
    return {
        "requests": len(samples), "ok": len(ok),
        "errors": [s.error for s in samples if not s.ok][:5],
        "wall_s": round(wall_s, 1),
        "ttft_all": ttft(ok),
        "ttft_predicted_hit": ttft([s for s in ok if s.predicted_hit]),
        "ttft_predicted_miss": ttft([s for s in ok if not s.predicted_hit]),
        "ttft_measured_hit": ttft([s for s in ok if s.measured_hit]),
        "ttft_measured_miss": ttft([s for s in ok if not s.measured_hit]),
        "confusion": {"tp": tp, "fp": fp, "fn": fn, "tn": tn},
        "precision": round(tp / (tp + fp), 3) if tp + fp else None,
        "recall": round(tp / (tp + fn), 3) if tp + fn else None,
        "cached_token_share": round(sum(s.cached_tokens for s in ok) / prompt, 3)
        if prompt else None,
        "per_worker": dict(sorted(per_worker.items())),
    }


PHASES = (("cachepilot", "priced"), ("round_robin", "round_robin"))


def run_experiment(workload: RealWorkload, out_dir: Path, workers: int = 2,
                   echo: Any = None, full_slots: bool = False,
                   spec: LlamaWorkerSpec | None = None) -> dict[str, Any]:
    """Each policy on a fresh stack (fresh caches), the same requests; figures and a plot.
    The directory assumes one typical prompt per slot, or with ``full_slots`` prompts that
    fill their slots' context (the upper bound an operator gets without a prompt length)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"workload": asdict(workload), "workers": workers,
                              "directory_assumes": "full slots" if full_slots
                              else "one typical prompt per slot"}
    phases: dict[str, list[Sample]] = {}
    for name, policy in PHASES:
        t0 = time.monotonic()
        load_before = os.getloadavg()[0]
        stack = LlamaStack(workers=workers, policy=policy, max_tokens=workload.max_tokens,
                           spec=spec,
                           log_dir=str(out_dir / f"logs-{name}"),
                           typical_prompt=None if full_slots else workload.typical_prompt())
        with stack:
            if echo:
                echo(f"{name}: {workers} llama-server workers up in "
                     f"{time.monotonic() - t0:.0f}s; sending {workload.requests} requests")
            samples, wall = asyncio.run(drive(stack, workload))
            assert stack.spec is not None and stack.calibration is not None
            phases[name] = samples
            result[name] = summarize(samples, wall) | {
                "policy": policy, "calibration": asdict(stack.calibration),
                "worker_spec": asdict(stack.spec),
                # Other processes on the machine skew TTFT: the 1-min load before and after.
                "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                "directory_capacity_blocks": stack.capacity_blocks,
                "directory_prompt_tokens": stack.prompt_tokens}
        if echo:
            r = result[name]
            echo(f"{name}: TTFT p50 {r['ttft_all']['p50_ms']} ms; predicted hits p50 "
                 f"{r['ttft_predicted_hit']['p50_ms']} ms, misses p50 "
                 f"{r['ttft_predicted_miss']['p50_ms']} ms; precision {r['precision']}, "
                 f"recall {r['recall']}")
    (out_dir / "samples.json").write_bytes(orjson.dumps(
        {k: [asdict(s) for s in v] for k, v in phases.items()}, option=orjson.OPT_INDENT_2))
    spec = result[PHASES[0][0]]["worker_spec"]
    plot(phases, out_dir / "real_model.png",
         f"Gemma 3 270M on llama.cpp: {workers} workers x {spec['threads']} thread(s), "
         f"{spec['parallel']} slot(s) each, through Envoy + the CachePilot gateway")
    result["plot"] = str(out_dir / "real_model.png")
    (out_dir / "results.json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    return result
