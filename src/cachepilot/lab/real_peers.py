"""``cachepilot experiment real-peers``: CachePilot and the peers' routers (sglang-router,
vllm-router from PyPI) in front of the same llama.cpp workers, the same requests, several
seeds and workloads.

For each (workload, seed) cell every router gets a phase of its own on fresh workers (fresh
caches, the same warm-up): the requests and their arrival times are the cell's, identical for
every router. The routers' order rotates from cell to cell so that a slow stretch of the
shared machine does not always fall on the same router; the 1-minute load average before and
after each phase is recorded. Hit rates are the workers' own counts (``cached_tokens`` over
``prompt_tokens`` of each answer); imbalance is the busiest worker's share of the prompt
tokens the workers were asked for (their ``/metrics``), the same measure for every router
since only CachePilot names the worker in its answer.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from cachepilot.lab import real_traffic as wl
from cachepilot.lab.real_model import drive
from cachepilot.lab.real_model import summarize as cachepilot_summary
from cachepilot.records.stats import imbalance
from cachepilot.sim.llamacpp import LLAMA_WORKLOADS
from cachepilot.sim.workloads import SimRequest, WorkloadSpec
from cachepilot.tooling.llamacpp.routers import ROUTERS, RouterSpec
from cachepilot.tooling.llamacpp.stack import LlamaStack
from cachepilot.tooling.llamacpp.worker import LlamaWorkerSpec
from cachepilot.tooling.loadgen import Result, run
from cachepilot.tooling.loadgen import summarize as loadgen_summary
from cachepilot.tooling.procs import http_get

# Sized for two single-thread workers on 2 cores (a cold ~550-token prefill ≈ 1.7 s); the
# specs and why: cachepilot.sim.llamacpp.LLAMA_WORKLOADS (the peers study simulates them).
WORKLOADS: dict[str, WorkloadSpec] = dict(LLAMA_WORKLOADS)
# The peers' default policy each. Round robin and power_of_two (--routers) are left out by
# default: on this shared 2-core machine a phase takes ~2-3 min, and the study must stay
# under an hour.
DEFAULT_ROUTERS = ("cachepilot", "sglang_cache_aware", "vllm_cache_aware")


@dataclass(frozen=True)
class StudyConfig:
    workloads: tuple[str, ...] = tuple(WORKLOADS)
    seeds: tuple[int, ...] = (11, 12, 13)
    routers: tuple[str, ...] = DEFAULT_ROUTERS
    requests: int = 20  # per phase
    rate: float | None = None  # None: each workload's own
    workers: int = 2
    spec: LlamaWorkerSpec | None = None  # None: the stack's default for ``workers``


class Progress:
    """What the study reports while it runs (the CLI draws bars; tests record)."""

    def phase(self, i: int, n: int, what: str) -> None: ...
    def request(self, done: int, total: int) -> None: ...
    def note(self, line: str) -> None: ...


def order(routers: tuple[str, ...], cell: int) -> list[str]:
    """The routers' order in cell ``cell``: rotated one place per cell."""
    k = cell % len(routers)
    return [*routers[k:], *routers[:k]]


def engine_counters(address: str) -> dict[str, float]:
    """A worker's cumulative prompt-token counters from its ``/metrics``: ``processed``
    (``llamacpp:prompt_tokens_total``) and ``cached``."""
    _, body = http_get(f"http://{address}/metrics", timeout=10.0)
    out = {"processed": 0.0, "cached": 0.0}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            if s.name == "llamacpp:prompt_tokens_total":
                out["processed"] = s.value
            elif s.name == "llamacpp:prompt_tokens_cached_total":
                out["cached"] = s.value
    return out


def _engine_summary(before: list[dict[str, float]], after: list[dict[str, float]]
                    ) -> dict[str, Any]:
    asked = [a["processed"] + a["cached"] - b["processed"] - b["cached"]
             for b, a in zip(before, after, strict=True)]
    cached = sum(a["cached"] - b["cached"] for b, a in zip(before, after, strict=True))
    return {"imbalance": round(imbalance(asked), 3),
            "engine_prompt_tokens": [int(x) for x in asked],
            "engine_token_hit_rate": round(cached / sum(asked), 3) if sum(asked) else None}


def run_phase(router: RouterSpec, reqs: list[SimRequest], cfg: StudyConfig, log_dir: str,
              progress: Progress) -> tuple[dict[str, Any], list[Result]]:
    """One router on fresh workers: start, warm up, send the cell's requests, measure."""
    t0 = time.monotonic()
    load_before = os.getloadavg()[0]
    stack = LlamaStack(workers=cfg.workers, spec=cfg.spec, log_dir=log_dir,
                       policy=router.policy, peer=router if router.is_peer else None,
                       max_tokens=int(reqs[0].max_tokens))
    with stack:
        started = time.monotonic() - t0
        before = [engine_counters(a) for a in stack.worker_addresses]
        if router.is_peer:
            labelled = wl.bodies(reqs)
            samples, wall = asyncio.run(run(
                stack.url, [r.arrival for r in reqs], [b for _, b in labelled],
                progress.request, timeout_s=600.0))
            for (doc, _), r in zip(labelled, samples, strict=True):
                r.label = doc
            summary = loadgen_summary(samples, wall)
        else:
            samples, wall = asyncio.run(drive(stack, reqs, progress.request))
            summary = cachepilot_summary(samples, wall)
        after = [engine_counters(a) for a in stack.worker_addresses]
        assert stack.spec is not None and stack.calibration is not None
        summary |= _engine_summary(before, after) | {
            "router": router.name, "kind": router.kind, "policy": router.policy,
            "start_s": round(started, 1), "wall_s": round(wall, 1),
            "error_samples": [r.error for r in samples if not r.ok][:5],
            "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "calibration": asdict(stack.calibration), "worker_spec": asdict(stack.spec),
            "directory": stack.directory}  # the gateway's, sized from /props (CachePilot)
    summary.pop("per_worker", None)  # only CachePilot's answers name the worker
    return summary, samples


def run_study(cfg: StudyConfig, log_root: str, progress: Progress | None = None,
              ) -> dict[str, Any]:
    """Every router on every (workload, seed) cell; the phases' summaries and samples."""
    progress = progress or Progress()
    t0 = time.monotonic()
    cells = [(w, s) for w in cfg.workloads for s in cfg.seeds]
    n_phases = len(cells) * len(cfg.routers)
    phases: list[dict[str, Any]] = []
    samples: list[dict[str, Any]] = []
    i = 0
    for c, (wname, seed) in enumerate(cells):
        spec = WORKLOADS[wname]
        if cfg.rate:
            spec = spec.with_(rate=cfg.rate)
        reqs = wl.requests(spec, cfg.requests, seed)
        for name in order(cfg.routers, c):
            progress.phase(i, n_phases, f"{wname} seed {seed}: {name}")
            summary, res = run_phase(ROUTERS[name], reqs, cfg,
                                     os.path.join(log_root, f"{wname}-{seed}-{name}"), progress)
            phases.append({"workload": wname, "seed": seed, "position": i, **summary})
            samples += [{"workload": wname, "seed": seed, "router": name, "request": k,
                         "label": r.label, "ok": r.ok, "ttft_s": r.ttft_s,
                         "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                         "predicted_hit": r.predicted_hit} for k, r in enumerate(res)]
            progress.note(_line(phases[-1]))
            i += 1
    progress.phase(n_phases, n_phases, "done")
    return {"config": {**asdict(cfg), "spec": asdict(cfg.spec) if cfg.spec else None},
            "workloads": {w: (WORKLOADS[w].with_(rate=cfg.rate) if cfg.rate
                              else WORKLOADS[w]).to_dict() for w in cfg.workloads},
            "phases": phases, "samples": samples, "wall_s": round(time.monotonic() - t0, 1)}


def _line(p: dict[str, Any]) -> str:
    def ms(k: str) -> str:
        v = p.get(k)
        return "–" if v is None or v != v else f"{v * 1000:.0f}"

    return (f"{p['workload']} seed {p['seed']} {p['router']:20s} p50 {ms('ttft_p50_s')} "
            f"p90 {ms('ttft_p90_s')} p99 {ms('ttft_p99_s')} ms, hit rate "
            f"{p['token_hit_rate']}, imbalance {p['imbalance']}, errors {p['errors']}, "
            f"load {p['loadavg_1m'][0]} → {p['loadavg_1m'][1]}")

