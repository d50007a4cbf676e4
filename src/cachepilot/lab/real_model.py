"""``cachepilot experiment real-model`` on llama.cpp: the same requests through a fresh
llama.cpp stack per policy (:class:`cachepilot.tooling.llamacpp.LlamaStack`), each answer
joined with the gateway's prediction; figures, samples, a plot and a report. Keys as the load
generator's summary (``ttft_p50_s``…, ``token_hit_rate``, ``imbalance``; seconds)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from cachepilot.lab.output import StudyOutput
from cachepilot.lab.real_traffic import APIS, REQUESTS, SEED, WORKLOAD, bodies, requests
from cachepilot.records.stats import ttft_summary
from cachepilot.sim.workloads import SimRequest, WorkloadSpec
from cachepilot.tooling.llamacpp.stack import LlamaStack
from cachepilot.tooling.llamacpp.worker import MODEL_NAME, LlamaWorkerSpec
from cachepilot.tooling.loadgen import Result, run
from cachepilot.tooling.loadgen import summarize as loadgen_summary

if TYPE_CHECKING:
    from matplotlib.figure import Figure


async def drive(stack: Any, reqs: list[SimRequest],
                progress: Callable[[int, int], None] | None = None, api: str = "chat",
                model: str = MODEL_NAME) -> tuple[list[Result], float]:
    """Send the requests through Envoy at their arrival times (``stack``: a llama.cpp or
    vLLM stack); :func:`join_predictions` adds the gateway's predictions afterwards (in
    the peers study, once the router's CPU has been read: the look-ups are the study's,
    not routing's)."""
    labelled = bodies(reqs, api, model)
    results, wall = await run(stack.url, [r.arrival for r in reqs],
                              [b for _, b in labelled], progress, timeout_s=600.0,
                              path=APIS[api])
    for (doc, _), r in zip(labelled, results, strict=True):
        r.label = doc
    return results, wall


def join_predictions(stack: Any, results: list[Result]) -> None:
    """Each answer's decision record (the gateway's prediction), from its admin API."""
    for r in results:
        rec = stack.decision(r.decision_id) if r.decision_id else None
        if rec is not None:
            r.predicted_hit = bool(rec["predicted_hit"])
            r.predicted_cached_tokens = int(rec["predicted_cached_tokens"])


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


def run_experiment(output: StudyOutput, workload: WorkloadSpec = WORKLOAD, n: int = REQUESTS,
                   seed: int = SEED, workers: int = 2, echo: Any = None,
                   spec: LlamaWorkerSpec | None = None) -> dict[str, Any]:
    """Each policy on a fresh stack (fresh caches), the same requests; figures, samples, a
    plot and a report in ``output``. The gateway sizes its directory from each worker's
    slots (llama-server's /props)."""
    reqs = requests(workload, n, seed)
    result: dict[str, Any] = {"workload": workload.to_dict(), "seed": seed,
                              "requests": len(reqs), "workers": workers,
                              "directory_assumes": "each worker's slots (GET /props)"}
    phases: dict[str, list[Result]] = {}
    for name, policy in PHASES:
        t0 = time.monotonic()
        load_before = os.getloadavg()[0]
        stack = LlamaStack(workers=workers, policy=policy, max_tokens=int(workload.output.median),
                           spec=spec, log_dir=str(output.out / f"logs-{name}"))
        with stack:
            if echo:
                echo(f"{name}: {workers} llama-server workers up in "
                     f"{time.monotonic() - t0:.0f}s; sending {len(reqs)} requests")
            samples, wall = asyncio.run(drive(stack, reqs))
            join_predictions(stack, samples)
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
    output.data("samples.json", {k: [asdict(s) for s in v] for k, v in phases.items()},
                indent=True)
    used = result[PHASES[0][0]]["worker_spec"]
    name = output.figure(plot(phases, f"Gemma 3 270M on llama.cpp: {workers} workers x "
                                      f"{used['threads']} thread(s), {used['parallel']} slot(s) "
                                      "each, through Envoy + the CachePilot gateway"),
                         "real_model.png")
    result["plot"] = str(output.out / name)
    output.write(report(result, name), result)
    return result


def _ms(x: float | None) -> str:
    return "–" if x is None or x != x else f"{x * 1000:.0f}"


def rows(result: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """The figures per policy (TTFTs in ms): what the command prints and the report shows."""
    names = [n for n, _ in PHASES]
    out = [("TTFT mean, all (ms)", [_ms(result[n]["ttft_mean_s"]) for n in names]),
           ("TTFT p50 / p90, all (ms)",
            [f"{_ms(result[n]['ttft_p50_s'])} / {_ms(result[n]['ttft_p90_s'])} "
             f"(n={result[n]['requests'] - result[n]['errors']})" for n in names])]
    for label, key in (("TTFT p50 / p90, predicted hits", "ttft_predicted_hit"),
                       ("TTFT p50 / p90, predicted misses", "ttft_predicted_miss")):
        out.append((label, [f"{_ms(result[n][key]['ttft_p50_s'])} / "
                            f"{_ms(result[n][key]['ttft_p90_s'])} (n={result[n][key]['n']})"
                            for n in names]))
    for label, key in (("hit precision", "precision"), ("hit recall", "recall"),
                       ("cached share of prompt tokens", "token_hit_rate")):
        out.append((label, [str(result[n][key]) for n in names]))
    return out


def report(result: dict[str, Any], plot_name: str) -> str:
    names = [n for n, _ in PHASES]
    w = result["workload"]
    L = ["# Hit prediction on a real model: Gemma 3 270M on llama.cpp", "",
         f"{result['requests']} requests ({w['kind']}, {w['rate']:g} req/s, seed "
         f"{result['seed']}) through Envoy and the gateway to {result['workers']} llama-server "
         "workers, once per policy on fresh workers; the gateway's directory assumes "
         f"{result['directory_assumes']}. TTFT at the client; a predicted hit is the "
         "gateway's decision record, joined with the answer.", "",
         "| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    L += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows(result)]
    L += ["", f"![TTFT by prediction, TTFT CDF]({plot_name})", ""]
    return "\n".join(L)


def plot(phases: dict[str, list[Result]], title: str) -> Figure:
    """TTFT by the gateway's hit prediction (boxes) and the TTFT CDF per policy."""
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    from cachepilot.lab.plots import plt  # matplotlib, Agg backend

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ax = axes[0]
    labels, data = [], []
    for name, samples in phases.items():
        for pred, tag in ((True, "pred. hit"), (False, "pred. miss")):
            v = [s.ttft_s * 1000.0 for s in samples if s.ok and s.predicted_hit is pred
                 and s.ttft_s is not None]
            labels.append(f"{name}\n{tag}\n(n={len(v)})")
            data.append(v or [float("nan")])
    ax.boxplot(data, showfliers=True)
    ax.set_xticks(range(1, len(labels) + 1), labels, fontsize=8)
    if any(v == v for group in data for v in group):  # any measured value (NaN != NaN)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylabel("TTFT at the client (ms, log)")
    ax.set_title("TTFT by the gateway's prediction")
    ax = axes[1]
    for name, samples in phases.items():
        v = sorted(s.ttft_s * 1000.0 for s in samples if s.ok and s.ttft_s is not None)
        if v:
            ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=name)
    if ax.lines:
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.legend()
    ax.set_xlabel("TTFT (ms, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF, same traffic")
    fig.suptitle(title)
    fig.tight_layout()
    return fig
