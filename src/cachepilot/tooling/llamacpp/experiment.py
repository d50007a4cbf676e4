"""The real-model study: the same requests through a fresh llama.cpp stack per policy, each
answer joined with the gateway's prediction; figures, samples and a plot. Keys as the load
generator's summary (``ttft_p50_s``…, ``token_hit_rate``, ``imbalance``; seconds)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson

from cachepilot.records.stats import ttft_summary
from cachepilot.sim.workloads import SimRequest, WorkloadSpec
from cachepilot.tooling.llamacpp.plots import plot
from cachepilot.tooling.llamacpp.stack import LlamaStack
from cachepilot.tooling.llamacpp.worker import LlamaWorkerSpec
from cachepilot.tooling.llamacpp.workload import (
    REQUESTS,
    SEED,
    WORKLOAD,
    bodies,
    requests,
)
from cachepilot.tooling.loadgen import Result, run
from cachepilot.tooling.loadgen import summarize as loadgen_summary


async def drive(stack: LlamaStack, reqs: list[SimRequest],
                progress: Callable[[int, int], None] | None = None
                ) -> tuple[list[Result], float]:
    """Send the requests through Envoy at their arrival times; join each answer with its
    decision record (the gateway's prediction)."""
    labelled = bodies(reqs)
    results, wall = await run(stack.url, [r.arrival for r in reqs],
                              [b for _, b in labelled], progress, timeout_s=600.0)
    for (doc, _), r in zip(labelled, results, strict=True):
        r.label = doc
        rec = await asyncio.to_thread(stack.decision, r.decision_id) if r.decision_id else None
        if rec is not None:
            r.predicted_hit = bool(rec["predicted_hit"])
            r.predicted_cached_tokens = int(rec["predicted_cached_tokens"])
    return results, wall


def _ttft(group: list[Result]) -> dict[str, Any]:
    v = [r.ttft_s for r in group if r.ttft_s is not None]
    return {"n": len(v), **{k: None if x != x else round(x, 4)  # NaN (no value) → None
                            for k, x in ttft_summary(v).items()}}


def summarize(results: list[Result], wall_s: float) -> dict[str, Any]:
    """The load generator's summary of every answer, plus TTFT by predicted and measured
    hit/miss and the prediction scored against the worker's count of cached tokens."""
    ok = [r for r in results if r.ok and r.ttft_s is not None and r.predicted_hit is not None]
    tp = sum(1 for r in ok if r.predicted_hit and r.measured_hit)
    fp = sum(1 for r in ok if r.predicted_hit and not r.measured_hit)
    fn = sum(1 for r in ok if not r.predicted_hit and r.measured_hit)
    tn = len(ok) - tp - fp - fn
    return loadgen_summary(results, wall_s) | {
        "predicted": len(ok),  # answered, with the gateway's decision record
        "error_samples": [r.error for r in results if not r.ok][:5],
        "wall_s": round(wall_s, 1),
        "ttft_predicted_hit": _ttft([r for r in ok if r.predicted_hit]),
        "ttft_predicted_miss": _ttft([r for r in ok if not r.predicted_hit]),
        "ttft_measured_hit": _ttft([r for r in ok if r.measured_hit]),
        "ttft_measured_miss": _ttft([r for r in ok if not r.measured_hit]),
        "confusion": {"tp": tp, "fp": fp, "fn": fn, "tn": tn},
        "precision": round(tp / (tp + fp), 3) if tp + fp else None,
        "recall": round(tp / (tp + fn), 3) if tp + fn else None,
    }


PHASES = (("cachepilot", "priced"), ("round_robin", "round_robin"))


def run_experiment(out_dir: Path, workload: WorkloadSpec = WORKLOAD, n: int = REQUESTS,
                   seed: int = SEED, workers: int = 2, echo: Any = None,
                   spec: LlamaWorkerSpec | None = None) -> dict[str, Any]:
    """Each policy on a fresh stack (fresh caches), the same requests; figures and a plot.
    The gateway sizes its directory from each worker's slots (llama-server's /props)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    reqs = requests(workload, n, seed)
    result: dict[str, Any] = {"workload": workload.to_dict(), "seed": seed,
                              "requests": len(reqs), "workers": workers,
                              "directory_assumes": "each worker's slots (GET /props)"}
    phases: dict[str, list[Result]] = {}
    for name, policy in PHASES:
        t0 = time.monotonic()
        load_before = os.getloadavg()[0]
        stack = LlamaStack(workers=workers, policy=policy, max_tokens=int(workload.output.median),
                           spec=spec, log_dir=str(out_dir / f"logs-{name}"))
        with stack:
            if echo:
                echo(f"{name}: {workers} llama-server workers up in "
                     f"{time.monotonic() - t0:.0f}s; sending {len(reqs)} requests")
            samples, wall = asyncio.run(drive(stack, reqs))
            assert stack.spec is not None and stack.calibration is not None
            phases[name] = samples
            result[name] = summarize(samples, wall) | {
                "policy": policy, "calibration": asdict(stack.calibration),
                "worker_spec": asdict(stack.spec),
                # Other processes on the machine skew TTFT: the 1-min load before and after.
                "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                "directory": stack.directory}
        if echo:
            r = result[name]
            echo(f"{name}: TTFT p50 {r['ttft_p50_s']} s; predicted hits p50 "
                 f"{r['ttft_predicted_hit']['ttft_p50_s']} s, misses p50 "
                 f"{r['ttft_predicted_miss']['ttft_p50_s']} s; precision {r['precision']}, "
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
