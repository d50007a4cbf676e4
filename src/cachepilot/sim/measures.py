"""Per-run measures: TTFT percentiles, throughput, token hit rate, evictions, imbalance,
utilization, and the ratio to the ideal bound. The keys shared with the load generator and
the real-model experiment (``ttft_p50_s``…, ``token_hit_rate``, ``imbalance``,
``throughput_rps``, ``requests``) mean the same there (:mod:`cachepilot.records.stats`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from cachepilot.records.stats import imbalance, ttft_summary
from cachepilot.sim.simulator import RunResult


def summarize(run: RunResult, ideal: np.ndarray | None = None) -> dict[str, Any]:
    outs = run.results
    done = [o for o in outs if o.finished_at is not None]
    ttft = np.array([o.ttft_s for o in outs if o.ttft_s is not None])
    prompt = sum(o.prompt_tokens for o in outs if o.worker is not None and o.ttft_s is not None)
    cached = sum(o.cached_tokens for o in outs if o.ttft_s is not None)
    makespan = run.makespan
    workers = run.workers
    assigned = np.array([w["assigned"] for w in workers.values()], dtype=float)
    busy = np.array([w["busy_time"] for w in workers.values()], dtype=float)

    out: dict[str, Any] = {
        "requests": len(outs),
        "completed": len(done),
        "rejected": sum(1 for o in outs if o.rejected),
        **ttft_summary(ttft),
        "throughput_rps": len(done) / makespan if makespan > 0 else float("nan"),
        "throughput_out_tps": (sum(o.output_tokens for o in done) / makespan
                               if makespan > 0 else float("nan")),
        "throughput_prompt_tps": (sum(o.prompt_tokens for o in done) / makespan
                                  if makespan > 0 else float("nan")),
        "token_hit_rate": cached / prompt if prompt else float("nan"),
        "evictions": int(sum(w["evictions"] for w in workers.values())),
        # requests per worker, as the load generator counts them; and busy time
        "imbalance": imbalance(assigned),
        "imbalance_assigned": imbalance(assigned),
        "imbalance_busy": imbalance(busy),
        "utilization": {a: round(w["utilization"], 4) for a, w in workers.items()},
        "max_waiting_scraped": int(max((w["max_waiting_scraped"] for w in workers.values()),
                                       default=0)),
        "makespan_s": makespan,
        "wall_s": run.wall_s,
        "sim_rps": len(outs) / run.wall_s if run.wall_s > 0 else float("nan"),
    }
    if ideal is not None and ideal.size:
        out["ideal_p50_s"] = float(np.median(ideal))
        out["p50_over_ideal"] = out["ttft_p50_s"] / out["ideal_p50_s"]
    # The predictor's accuracy: |measured − predicted| TTFT of the chosen worker, the
    # prediction made at routing time.
    pairs = np.array([(o.ttft_s, o.predicted_ttft_s) for o in outs
                      if o.ttft_s is not None and o.predicted_ttft_s is not None])
    if pairs.size:
        err = np.abs(pairs[:, 0] - pairs[:, 1])
        rel = err / np.maximum(pairs[:, 0], 1e-9)
        out["predictor_abs_error_p50_s"] = float(np.median(err))
        out["predictor_abs_error_p90_s"] = float(np.percentile(err, 90))
        out["predictor_rel_error_p50"] = float(np.median(rel))
        out["predictor_rel_error_p90"] = float(np.percentile(rel, 90))
    return out


def ttft_sample(run: RunResult, n: int = 400) -> list[float]:
    """An evenly spaced quantile sample of the TTFT distribution (for plots and JSON)."""
    ttft = np.array([o.ttft_s for o in run.results if o.ttft_s is not None])
    if not ttft.size:
        return []
    return [float(x) for x in np.quantile(ttft, np.linspace(0, 1, n))]
