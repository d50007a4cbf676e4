"""`cachepilot experiment flow`: flow control under a flooding tenant, scheme by scheme.

The workload (:func:`mix`): four simulated workers; one tenant floods band 0 at
``FLOOD_X`` times the pool's capacity for 40 of the 60 s; three light tenants share band 0
at a steady 4 req/s each; a critical tenant runs in band 10 and a sheddable batch tenant in
band -1. Every tenant reuses its own documents (shared prefixes; ~2k tokens each). Clients
cap the output at 1024 tokens (``client_max_tokens``), so flow control estimates the output
and corrects it at completion, as it must in a gateway.

The schemes (:data:`SCHEMES`) all route with the priced router; they differ in when a
request goes and which goes first:

* ``reject`` — today without flow control: the admission limit (128 waiting per worker),
  then 429.
* ``fcfs`` — our gate and bounds, one FIFO per band (holding without fairness).
* ``vtc`` — the VTC paper's counters (Sheng et al., OSDI'24; input charged at dispatch,
  output per generated token, lift on becoming backlogged, argmin counter, oldest first) on
  our hold queue and gate: no locality, no prefix-holder waits, no decay.
* ``llm-d`` and ``llm-d+LAS`` — the llm-d router's flow control with its defaults, and with
  its least-attained-service fairness (:mod:`cachepilot.sim.llmd_flow`, code cited there).
* ``ours`` — the gateway's defaults (:mod:`cachepilot.core.flow`); ``ours B=0`` and
  ``ours B=inf`` vary how far locality may bend fairness (strict fair order; no bound).

Measures per run (:func:`measure`): per tenant p50/p99 TTFT including time held (completed
requests), refusals by reason, Jain's index over band 0's tenants' normalised service
(:func:`cachepilot.lab.flow_stats.normalised_jain`, in 10 s windows), the token hit rate,
throughput. :mod:`cachepilot.lab.flow_report` compares them across paired seeds.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from cachepilot.core.flow.config import FlowConfig
from cachepilot.core.flow.control import FlowControl
from cachepilot.core.flow.pick import FairPicker
from cachepilot.core.router import Router
from cachepilot.lab.flow_stats import normalised_jain
from cachepilot.lab.parallel import Progress, run_tasks
from cachepilot.sim.flow_driver import SimFlow
from cachepilot.sim.llmd_flow import llmd
from cachepilot.sim.simulator import RunResult, SimConfig, Simulator
from cachepilot.sim.workloads import Dist, SimRequest, Workload, WorkloadSpec, generate

WORKERS = 4
CAPACITY_RPS = 55.0  # the pool's throughput on this workload, measured (docs/flow-control.md)
FLOOD_X = 3.0
DURATION_S, FLOOD_FROM_S, FLOOD_TO_S = 60.0, 10.0, 50.0
WINDOW_S = 10.0
CLIENT_MAX_TOKENS = 1024
IN_W, OUT_W = 1.0, 2.0  # weighted tokens, as the schedulers count service
DEV_SEEDS = tuple(range(10))  # the defaults were tuned on these…
REPORT_SEEDS = tuple(range(100, 110))  # …and are reported on these


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    priority: int
    rate: float
    start: float = 0.0
    end: float = DURATION_S

    @property
    def light(self) -> bool:
        return self.name.startswith("light")


TENANTS = (
    Tenant("flood", 0, FLOOD_X * CAPACITY_RPS, FLOOD_FROM_S, FLOOD_TO_S),
    Tenant("light-1", 0, 4.0), Tenant("light-2", 0, 4.0), Tenant("light-3", 0, 4.0),
    Tenant("critical", 10, 3.0),
    Tenant("batch", -1, 6.0),
)


def mix(seed: int, tenants: tuple[Tenant, ...] = TENANTS) -> Workload:
    """Every tenant's requests, merged by arrival: its own documents, its own arrivals."""
    reqs: list[SimRequest] = []
    for i, t in enumerate(tenants):
        spec = WorkloadSpec("shared_prefix", rate=t.rate, duration=t.end - t.start, groups=8,
                            prefix=Dist(2048, 0.3, 512, 4096))
        for r in generate(spec, seed * 100 + i).requests:
            r.arrival += t.start
            r.group = f"{t.name}/{r.group}"
            r.extra = {"tenant": t.name, "priority": t.priority,
                       "client_max_tokens": CLIENT_MAX_TOKENS}
            reqs.append(r)
    reqs.sort(key=lambda r: r.arrival)
    for i, r in enumerate(reqs):
        r.id = i
    return Workload(WorkloadSpec("shared_prefix", duration=DURATION_S), seed, reqs)


def _vtc_build(router: Router, config: FlowConfig) -> FlowControl:
    """The paper's rules: argmin counter, oldest first; lift to backlogged tenants only."""
    flow = FlowControl(router, config, picker=FairPicker(config, shortest_first=False))
    flow.lift_to_virtual = False
    return flow


SCHEMES: dict[str, SimFlow | None] = {
    "reject": None,
    "fcfs": SimFlow("fcfs", FlowConfig(fairness="fcfs", holder_wait_ms=0.0)),
    "vtc": SimFlow("vtc", FlowConfig(bend_tokens=0.0, lookahead=1, half_life_s=0.0,
                                     holder_wait_ms=0.0),
                   build=_vtc_build, charge_as_generated=True),
    "llm-d": llmd("global-strict"),
    "llm-d+LAS": llmd("las"),
    "ours": SimFlow("ours", FlowConfig()),
    "ours B=0": SimFlow("ours B=0", FlowConfig(bend_tokens=0.0)),
    "ours B=inf": SimFlow("ours B=inf", FlowConfig(bend_tokens=math.inf)),
}
BASE = SimConfig(workers=WORKERS, scrape_interval_s=0.05, drain_limit_s=120.0)


def run_scheme(scheme: str, wl: Workload, base: SimConfig = BASE) -> RunResult:
    return Simulator(replace(base, flow=SCHEMES[scheme])).run(wl)


def run_task(task: tuple[str, int]) -> dict[str, Any]:
    scheme, seed = task
    t0 = time.perf_counter()
    res = measure(run_scheme(scheme, mix(seed)))
    return {"scheme": scheme, "seed": seed, "wall_s": time.perf_counter() - t0, **res}


def run_all(seeds: tuple[int, ...], schemes: tuple[str, ...] = tuple(SCHEMES),
            processes: int | None = None, progress: Progress | None = None
            ) -> list[dict[str, Any]]:
    # Flood-heavy holding schemes are the slow ones: first, so every process stays busy.
    tasks = [(s, seed) for s in schemes for seed in seeds]
    return run_tasks(run_task, tasks, processes, progress, label=lambda t: f"{t[0]} #{t[1]}")


def _weighted(prompt: int, output: int) -> float:
    return IN_W * prompt + OUT_W * output


def measure(run: RunResult) -> dict[str, Any]:
    """One run's measures, per tenant and overall (TTFT includes time held)."""
    by: dict[str, list[Any]] = {}
    for o in run.results:
        by.setdefault(o.tenant or "default", []).append(o)
    tenants: dict[str, dict[str, Any]] = {}
    for name, outs in sorted(by.items()):
        ttft = np.array([o.ttft_s for o in outs if o.ttft_s is not None])
        tenants[name] = {
            "requests": len(outs),
            "completed": sum(1 for o in outs if o.finished_at is not None),
            "refused": dict(Counter(o.rejected for o in outs if o.rejected)),
            "ttft_p50_s": float(np.percentile(ttft, 50)) if ttft.size else math.nan,
            "ttft_p99_s": float(np.percentile(ttft, 99)) if ttft.size else math.nan,
            "held_mean_s": float(np.mean([o.held_s for o in outs])) if outs else 0.0,
        }
    light = np.array([o.ttft_s for o in run.results
                      if o.tenant.startswith("light") and o.ttft_s is not None])
    done = [o for o in run.results if o.finished_at is not None]
    busy = [o for o in run.results if o.first_token_at is not None
            and FLOOD_FROM_S <= o.first_token_at < FLOOD_TO_S]
    prompt = sum(o.prompt_tokens for o in done)
    span = run.makespan or 1.0
    jains = _window_jain(run)
    return {
        "tenants": tenants,
        "light_p99_s": float(np.percentile(light, 99)) if light.size else math.nan,
        "light_p50_s": float(np.percentile(light, 50)) if light.size else math.nan,
        "light_refused": sum(sum(t["refused"].values()) for n, t in tenants.items()
                             if n.startswith("light")),
        "jain": float(np.nanmean(jains)) if jains else math.nan,
        "jain_min": float(np.nanmin(jains)) if jains else math.nan,
        "token_hit_rate": sum(o.cached_tokens for o in done) / prompt if prompt else math.nan,
        "throughput_rps": len(done) / span,
        # While the flood saturates the pool: first tokens per second, and their tokens.
        "saturated_rps": len(busy) / (FLOOD_TO_S - FLOOD_FROM_S),
        "saturated_tokens_s": sum(_weighted(o.prompt_tokens, o.output_tokens)
                                  for o in busy) / (FLOOD_TO_S - FLOOD_FROM_S),
        "refused": dict(Counter(o.rejected for o in run.results if o.rejected)),
        "makespan_s": run.makespan,
    }


def _window_jain(run: RunResult) -> list[float]:
    """Jain's index over band 0's tenants in each 10 s window of arrivals: service is the
    weighted tokens of requests whose first token came in the window, demand those of
    requests that arrived in it (a refused request is demand never served)."""
    out = []
    band0 = [o for o in run.results if o.priority == 0 and o.tenant]
    for start in np.arange(0.0, DURATION_S, WINDOW_S):
        end = start + WINDOW_S
        served: dict[str, float] = {}
        asked: dict[str, float] = {}
        for o in band0:
            w = _weighted(o.prompt_tokens, o.output_tokens)
            if start <= o.arrival < end:
                asked[o.tenant] = asked.get(o.tenant, 0.0) + w
            if o.first_token_at is not None and start <= o.first_token_at < end:
                served[o.tenant] = served.get(o.tenant, 0.0) + w
        if sum(1 for v in asked.values() if v > 0) > 1:
            out.append(normalised_jain(served, asked))
    return out
