"""``cachepilot experiment real-peers``: CachePilot and the peers' routers (sglang-router,
vllm-router from PyPI) in front of the same real workers (llama.cpp or vLLM), the same
requests (chat or text completions), several seeds and workloads.

For each (workload, seed) cell every router gets a phase of its own on fresh caches: fresh
llama.cpp workers (the same warm-up), or the same vLLM workers with their prefix caches
reset (a vLLM worker takes about a minute to start here); the requests and their arrival
times are the cell's, identical for every router. The routers' order rotates from cell to
cell so that a slow stretch of the shared machine does not always fall on the same router;
the 1-minute load average before and after each phase is recorded. Hit rates are the
workers' own counts (``cached_tokens`` over ``prompt_tokens`` of each answer); imbalance is
the busiest worker's share of the prompt tokens the workers were asked for (their
``/metrics``), the same measure for every router since only CachePilot names the worker in
its answer.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from cachepilot.lab import real_traffic as wl
from cachepilot.lab.real_model import drive, join_predictions
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
from cachepilot.tooling.vllm.calibration import calibrate_vllm, vllm_cost
from cachepilot.tooling.vllm.stack import VllmStack
from cachepilot.tooling.vllm.worker import VllmWorkerSpec

# Sized for two single-thread workers on 2 cores (a cold ~550-token prefill ≈ 1.7 s); the
# specs and why: cachepilot.sim.llamacpp.LLAMA_WORKLOADS (the peers study simulates them).
WORKLOADS: dict[str, WorkloadSpec] = dict(LLAMA_WORKLOADS)
# The peers' default policy each. Round robin and power_of_two (--routers) are left out by
# default: on this shared 2-core machine a phase takes ~2-3 min, and the study must stay
# under an hour.
DEFAULT_ROUTERS = ("cachepilot", "sglang_cache_aware", "vllm_cache_aware")


ENGINES = ("llamacpp", "vllm")


@dataclass(frozen=True)
class StudyConfig:
    workloads: tuple[str, ...] = tuple(WORKLOADS)
    seeds: tuple[int, ...] = (11, 12, 13)
    routers: tuple[str, ...] = DEFAULT_ROUTERS
    requests: int = 20  # per phase
    rate: float | None = None  # None: each workload's own
    workers: int = 2
    spec: LlamaWorkerSpec | None = None  # None: the stack's default for ``workers``
    engine: str = "llamacpp"  # or "vllm"
    api: str = "chat"  # or "completions"
    # CachePilot's phases share the TTFT predictor's fits (one --predictor-state file under
    # the logs), as one gateway running through the study would; False: each phase's
    # gateway starts from the calibrated prior (a phase is shorter than the warm-up).
    keep_predictor: bool = True


class Progress:
    """What the study reports while it runs (the CLI draws bars; tests record)."""

    def phase(self, i: int, n: int, what: str) -> None: ...
    def request(self, done: int, total: int) -> None: ...
    def note(self, line: str) -> None: ...


def order(routers: tuple[str, ...], cell: int) -> list[str]:
    """The routers' order in cell ``cell``: rotated one place per cell."""
    k = cell % len(routers)
    return [*routers[k:], *routers[:k]]


# Each engine's cumulative prompt-token counters: (tokens asked for, tokens from cache).
_COUNTERS = {"llamacpp": ("llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens_cached_total"),
             "vllm": ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")}


def engine_counters(address: str, engine: str = "llamacpp") -> dict[str, float]:
    """A worker's cumulative prompt tokens from its ``/metrics``: ``asked`` and ``cached``
    (llama.cpp counts processed and cached apart: asked is their sum)."""
    _, body = http_get(f"http://{address}/metrics", timeout=10.0)
    first, second = _COUNTERS[engine]
    vals = {first: 0.0, second: 0.0}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            name = s.name if s.name.endswith("_total") or s.name in vals else s.name + "_total"
            if name in vals:
                vals[name] += s.value
    asked = vals[first] + (vals[second] if engine == "llamacpp" else 0.0)
    return {"asked": asked, "cached": vals[second]}


def _engine_summary(before: list[dict[str, float]], after: list[dict[str, float]]
                    ) -> dict[str, Any]:
    asked = [a["asked"] - b["asked"] for b, a in zip(before, after, strict=True)]
    cached = sum(a["cached"] - b["cached"] for b, a in zip(before, after, strict=True))
    return {"imbalance": round(imbalance(asked), 3),
            "engine_prompt_tokens": [int(x) for x in asked],
            "engine_token_hit_rate": round(cached / sum(asked), 3) if sum(asked) else None}


def _send(stack: Any, router: RouterSpec, reqs: list[SimRequest], cfg: StudyConfig,
          progress: Progress) -> tuple[dict[str, Any], list[Result], float]:
    """The cell's requests through the router in front of ``stack``, and a peer's summary
    (CachePilot's answers are joined with its decisions, and summarised, by the caller
    once it has read the router's CPU)."""
    if router.is_peer:
        labelled = wl.bodies(reqs, cfg.api)
        samples, wall = asyncio.run(run(
            stack.url, [r.arrival for r in reqs], [b for _, b in labelled],
            progress.request, timeout_s=600.0, path=wl.APIS[cfg.api]))
        for (doc, _), r in zip(labelled, samples, strict=True):
            r.label = doc
        return loadgen_summary(samples, wall), samples, wall
    samples, wall = asyncio.run(drive(stack, reqs, progress.request, cfg.api))
    return {}, samples, wall  # summarised once its predictions are joined (run_phase)


def _cpu(stack: Any, vllm: VllmStack | None) -> tuple[float, float]:
    """CPU seconds used so far by the router's processes (Envoy and the gateway, or the peer
    router) and by the workers: on a machine whose cores the workers compute on, what the
    router burns is taken from them."""
    if vllm is not None:
        return vllm.router_processes.cpu_seconds(), vllm.processes.cpu_seconds()
    procs = stack.processes
    return (procs.cpu_seconds(lambda n: not n.startswith("llama-")),
            procs.cpu_seconds(lambda n: n.startswith("llama-")))


def run_phase(router: RouterSpec, reqs: list[SimRequest], cfg: StudyConfig, log_dir: str,
              progress: Progress, vllm: VllmStack | None = None
              ) -> tuple[dict[str, Any], list[Result]]:
    """One router on fresh caches: fresh llama.cpp workers (start, warm up), or ``vllm``'s
    workers with their caches reset; send the cell's requests, measure."""
    t0 = time.monotonic()
    load_before = os.getloadavg()[0]
    extra: dict[str, Any] = {}
    state = (os.path.join(os.path.dirname(log_dir), "predictor-state.json")
             if cfg.keep_predictor else None)
    if vllm is not None:
        vllm.reset_caches()
        vllm.predictor_state = state
        vllm.start_router(router.policy, router if router.is_peer else None, log_dir)
        stack: Any = vllm
        extra = {"calibration": vllm.calibration, "worker_spec": {
            "block_size": vllm.spec.block_size, "max_num_seqs": vllm.spec.max_num_seqs,
            "kv_cache_gib": vllm.spec.kv_cache_gib}}
    else:
        stack = LlamaStack(workers=cfg.workers, spec=cfg.spec, log_dir=log_dir,
                           policy=router.policy, peer=router if router.is_peer else None,
                           max_tokens=int(reqs[0].max_tokens), predictor_state=state).start()
    try:
        started = time.monotonic() - t0
        before = [engine_counters(a, cfg.engine) for a in stack.worker_addresses]
        cpu_before = _cpu(stack, vllm)
        summary, samples, wall = _send(stack, router, reqs, cfg, progress)
        cpu = [b - a for a, b in zip(cpu_before, _cpu(stack, vllm), strict=True)]
        if not router.is_peer:  # after the CPU reading: these look-ups are the study's
            join_predictions(stack, samples)
            summary = cachepilot_summary(samples, wall)
        after = [engine_counters(a, cfg.engine) for a in stack.worker_addresses]
        if vllm is None:
            assert stack.spec is not None and stack.calibration is not None
            extra = {"calibration": asdict(stack.calibration),
                     "worker_spec": asdict(stack.spec),
                     "directory": stack.directory}  # the gateway's, sized from /props
    finally:
        if vllm is not None:
            vllm.stop_router()
        else:
            stack.stop()
    summary |= _engine_summary(before, after) | {
        "router": router.name, "kind": router.kind, "policy": router.policy,
        "engine": cfg.engine, "api": cfg.api,
        "start_s": round(started, 1), "wall_s": round(wall, 1),
        "router_cpu_ms_per_request": round(cpu[0] * 1000 / len(reqs), 1),
        "workers_cpu_s": round(cpu[1], 2),
        "error_samples": [r.error for r in samples if not r.ok][:5],
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)], **extra}
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
    vllm = None
    if cfg.engine == "vllm":  # up once for the study: the phases reset their caches
        progress.note("starting the vLLM workers (about a minute each)")
        vllm = start_vllm(cfg, os.path.join(log_root, "vllm-workers"))
    try:
        _cells(cfg, cells, n_phases, log_root, progress, phases, samples, vllm)
    finally:
        if vllm is not None:
            vllm.stop()
    progress.phase(n_phases, n_phases, "done")
    return {"config": {**asdict(cfg), "spec": asdict(cfg.spec) if cfg.spec else None},
            "workloads": {w: (WORKLOADS[w].with_(rate=cfg.rate) if cfg.rate
                              else WORKLOADS[w]).to_dict() for w in cfg.workloads},
            "phases": phases, "samples": samples, "wall_s": round(time.monotonic() - t0, 1)}


def start_vllm(cfg: StudyConfig, log_dir: str) -> VllmStack:
    """The study's vLLM workers (``/reset_prefix_cache`` on: a dev-mode endpoint), with the
    gateway's cost model measured on them as on llama.cpp workers."""
    spec = VllmWorkerSpec(extra_env=(("VLLM_SERVER_DEV_MODE", "1"),))
    stack = VllmStack(workers=cfg.workers, spec=spec, log_dir=log_dir).start_workers()
    try:
        cal = calibrate_vllm(stack.worker_addresses[0], spec.served_name)
        stack.calibration = asdict(cal)
        stack.cost = vllm_cost(cal)
    except BaseException:
        stack.stop()
        raise
    return stack


def _cells(cfg: StudyConfig, cells: list[tuple[str, int]], n_phases: int, log_root: str,
           progress: Progress, phases: list[dict[str, Any]], samples: list[dict[str, Any]],
           vllm: VllmStack | None) -> None:
    i = 0
    for c, (wname, seed) in enumerate(cells):
        spec = WORKLOADS[wname]
        if cfg.rate:
            spec = spec.with_(rate=cfg.rate)
        reqs = wl.requests(spec, cfg.requests, seed)
        for name in order(cfg.routers, c):
            progress.phase(i, n_phases, f"{wname} seed {seed}: {name}")
            summary, res = run_phase(ROUTERS[name], reqs, cfg,
                                     os.path.join(log_root, f"{wname}-{seed}-{name}"), progress,
                                     vllm)
            phases.append({"workload": wname, "seed": seed, "position": i, **summary})
            samples += [{"workload": wname, "seed": seed, "router": name, "request": k,
                         "label": r.label, "ok": r.ok, "ttft_s": r.ttft_s,
                         "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                         "predicted_hit": r.predicted_hit} for k, r in enumerate(res)]
            progress.note(_line(phases[-1]))
            i += 1


def _line(p: dict[str, Any]) -> str:
    def ms(k: str) -> str:
        v = p.get(k)
        return "–" if v is None or v != v else f"{v * 1000:.0f}"

    return (f"{p['workload']} seed {p['seed']} {p['router']:20s} p50 {ms('ttft_p50_s')} "
            f"p90 {ms('ttft_p90_s')} p99 {ms('ttft_p99_s')} ms, hit rate "
            f"{p['token_hit_rate']}, imbalance {p['imbalance']}, errors {p['errors']}, "
            f"load {p['loadavg_1m'][0]} → {p['loadavg_1m'][1]}")

