"""The flow-control study's report: per-scheme means over paired seeds, ours compared with
every other scheme (paired intervals that respect each measure's bounds, exact sign-flip
p-values, Holm's correction per family), and the issue's three criteria judged.

Writes ``report.md``, ``results.json`` (every run's measures) and ``flow.png`` through the
studies' one writer (:class:`cachepilot.lab.output.StudyOutput`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from cachepilot.lab import flow_study as fs
from cachepilot.lab.flow_stats import bootstrap_diff, holm, log_ratio

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from cachepilot.lab.output import StudyOutput

OURS = "ours"
# Priced routing without fairness: today's (reject at the limit) and holding in one FIFO.
UNFAIR = ("reject", "fcfs")
HIT_POINTS = 0.02
JAIN_BAR = 0.95


def _series(rows: list[dict[str, Any]], scheme: str, key: str) -> list[float]:
    by_seed = {r["seed"]: r for r in rows if r["scheme"] == scheme}
    return [float(by_seed[s][key]) for s in sorted(by_seed)]


def _tenant_series(rows: list[dict[str, Any]], scheme: str, tenant: str,
                   key: str) -> list[float]:
    by_seed = {r["seed"]: r for r in rows if r["scheme"] == scheme}
    return [float(by_seed[s]["tenants"].get(tenant, {}).get(key, math.nan))
            for s in sorted(by_seed)]


def analyse(rows: list[dict[str, Any]], schemes: list[str]) -> dict[str, Any]:
    others = [s for s in schemes if s != OURS and not s.startswith(f"{OURS} ")]
    light = {s: log_ratio(_series(rows, OURS, "light_p99_s"), _series(rows, s, "light_p99_s"))
             for s in others}
    light_holm = holm({s: c["p"] for s, c in light.items()})
    jain = {s: bootstrap_diff(_series(rows, OURS, "jain"), _series(rows, s, "jain"))
            for s in schemes if s != OURS}
    hit = {s: bootstrap_diff(_series(rows, OURS, "token_hit_rate"),
                             _series(rows, s, "token_hit_rate")) for s in schemes if s != OURS}
    tput = {s: log_ratio(_series(rows, OURS, "saturated_tokens_s"),
                         _series(rows, s, "saturated_tokens_s")) for s in schemes if s != OURS}
    ours_jain = _series(rows, OURS, "jain")
    return {
        "light_p99": {s: {**c, "holm": light_holm[s]} for s, c in light.items()},
        "jain": jain, "hit": hit, "throughput": tput,
        "criteria": {
            "jain_mean": float(np.mean(ours_jain)), "jain_min_seed": float(np.min(ours_jain)),
            "jain_ok": bool(np.min(ours_jain) >= JAIN_BAR),
            # Within 2 points: not lower by more than that (the interval's low end).
            "hit_within": {s: bool(hit[s]["lo"] >= -HIT_POINTS) for s in UNFAIR if s in hit},
            "light_lower_than_all": all(c["ratio"] < 1 and light_holm[s]
                                        for s, c in light.items()),
        },
    }


def _mean(xs: list[float]) -> float:
    finite = [x for x in xs if math.isfinite(x)]
    return float(np.mean(finite)) if finite else math.nan


def _fmt(x: float, digits: int = 2) -> str:
    return "–" if not math.isfinite(x) else f"{x:.{digits}f}"


def _table(rows: list[dict[str, Any]], schemes: list[str]) -> list[str]:
    head = ("| scheme | light p50 s | light p99 s | light refused | critical p99 s | flood p50 s "
            "| flood served | Jain (mean / worst window) | token hit rate | saturated ktok/s "
            "| refused (all) |")
    out = [head, "|" + "---|" * 11]
    for s in schemes:
        m = {k: _mean(_series(rows, s, k)) for k in (
            "light_p50_s", "light_p99_s", "light_refused", "jain", "jain_min",
            "token_hit_rate", "saturated_tokens_s")}
        crit = _mean(_tenant_series(rows, s, "critical", "ttft_p99_s"))
        flood = _mean(_tenant_series(rows, s, "flood", "ttft_p50_s"))
        served = _mean(_tenant_series(rows, s, "flood", "completed"))
        refused = float(np.mean([sum(r["refused"].values()) for r in rows if r["scheme"] == s]))
        out.append(f"| {s} | {_fmt(m['light_p50_s'])} | {_fmt(m['light_p99_s'])} | "
                   f"{_fmt(m['light_refused'], 1)} | {_fmt(crit)} | {_fmt(flood)} | "
                   f"{_fmt(served, 0)} | {_fmt(m['jain'], 3)} / {_fmt(m['jain_min'], 3)} | "
                   f"{_fmt(m['token_hit_rate'], 3)} | {m['saturated_tokens_s'] / 1000:.1f} | "
                   f"{refused:.0f} |")
    return out


def report(rows: list[dict[str, Any]], schemes: list[str], seeds: tuple[int, ...],
           wall_s: float, plot: str | None = None) -> str:
    a = analyse(rows, schemes)
    c = a["criteria"]
    lines = [
        "# Flow control under a flooding tenant",
        "",
        f"{len(rows)} runs, {wall_s / 60:.1f} min wall. Seeds "
        f"{seeds[0]}–{seeds[-1]}, paired (every scheme sees the same arrivals); the defaults "
        f"were chosen on seeds {fs.DEV_SEEDS[0]}–{fs.DEV_SEEDS[-1]}, never these.",
        "",
        f"Workload: {fs.WORKERS} simulated workers (capacity ≈ {fs.CAPACITY_RPS:g} req/s "
        f"on it); tenant `flood` at {fs.FLOOD_X:g}× capacity from {fs.FLOOD_FROM_S:g} s to "
        f"{fs.FLOOD_TO_S:g} s; `light-1..3` at 4 req/s each and `flood` in band 0; `critical` "
        "(3 req/s) in band 10; `batch` (6 req/s) sheddable in band −1; each tenant reuses its "
        f"own 8 documents of ~2k tokens; {fs.DURATION_S:g} s of arrivals. TTFT includes the "
        "time held; a refused request has no TTFT (refusals are counted apart).",
        "",
        *_table(rows, schemes),
        "",
        *([f"![light tenants' p99 TTFT and Jain's index by scheme]({plot})", ""] if plot
          else []),
        "Jain's index: in each 10 s window, band 0's tenants' service s_i (weighted tokens, "
        "1 × prompt + 2 × output, of requests whose first token came in the window) over "
        "their max-min fair share O_i of everything served given what each asked for in the "
        "window (demand d_i: the weighted tokens of the requests that arrived); J over "
        "x_i = s_i / O_i, averaged over windows (the worst window beside it). Normalising by "
        "the fair share, not by demand, keeps a flood's unmet demand from counting as "
        "unfairness.",
        "",
        "## Ours against each scheme (paired over seeds)",
        "",
        "| other scheme | light p99 ratio (95 % CI) | p | Holm | Jain Δ (95 % CI) "
        "| hit rate Δ points (95 % CI) | saturated throughput ratio (95 % CI) |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in schemes:
        if s == OURS:
            continue
        lp = a["light_p99"].get(s)
        j, h, t = a["jain"][s], a["hit"][s], a["throughput"][s]
        lp_text = (f"{lp['ratio']:.2f} ({lp['lo']:.2f}–{lp['hi']:.2f}) | {lp['p']:.4f} | "
                   f"{'significant' if lp['holm'] else 'not significant'}"
                   if lp else "(ablation) | – | –")
        lines.append(f"| {s} | {lp_text} | {j['diff']:+.3f} ({j['lo']:+.3f}…{j['hi']:+.3f}) | "
                     f"{100 * h['diff']:+.2f} ({100 * h['lo']:+.2f}…{100 * h['hi']:+.2f}) | "
                     f"{t['ratio']:.3f} ({t['lo']:.3f}–{t['hi']:.3f}) |")
    lines += [
        "",
        "Light p99 ratio: the geometric mean of ours ÷ theirs per seed, with a t interval on "
        "the log ratios; p: exact sign-flip permutation test; Holm over the comparisons in "
        "the table's ratio column (family-wise α = 0.05). Jain and hit rate: paired "
        "bootstrap of the mean difference (10 000 resamples), so intervals stay within what "
        "the bounded measures can reach.",
        "",
        "## The criteria",
        "",
        f"* Jain's index ≥ {JAIN_BAR}: mean {c['jain_mean']:.3f}, worst seed "
        f"{c['jain_min_seed']:.3f}: **{'met' if c['jain_ok'] else 'not met'}**.",
    ]
    for s, ok in c["hit_within"].items():
        h = a["hit"][s]
        lines.append(f"* Token hit rate within {100 * HIT_POINTS:g} points of `{s}` (priced "
                     f"routing without fairness): Δ {100 * h['diff']:+.2f} points "
                     f"({100 * h['lo']:+.2f}…{100 * h['hi']:+.2f}): "
                     f"**{'met' if ok else 'not met'}**.")
    lines.append("* Light tenants' p99 lower than under every other scheme, significant after "
                 f"Holm: **{'met' if c['light_lower_than_all'] else 'not met'}** (per scheme "
                 "above).")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], schemes: list[str]) -> Figure:
    """Per scheme: the light tenants' p99 TTFT (each seed a dot, the mean a bar; log scale)
    and Jain's index against the token hit rate (each seed a dot)."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for i, s in enumerate(schemes):
        p99 = [x for x in _series(rows, s, "light_p99_s") if math.isfinite(x) and x > 0]
        if p99:
            left.bar(i, float(np.exp(np.mean(np.log(p99)))), color="#9ecae1")
            left.scatter([i] * len(p99), p99, s=8, color="#08519c", zorder=3)
        right.scatter(_series(rows, s, "token_hit_rate"), _series(rows, s, "jain"), s=12,
                      label=s)
    left.set_yscale("log")
    left.set_xticks(range(len(schemes)), schemes, rotation=30, ha="right")
    left.set_ylabel("light tenants' p99 TTFT, s (bar: geometric mean)")
    right.set_xlabel("token hit rate")
    right.set_ylabel("Jain's index (mean over windows)")
    right.legend(fontsize=7)
    fig.tight_layout()
    return fig


def write(out: StudyOutput, rows: list[dict[str, Any]], schemes: list[str],
          seeds: tuple[int, ...], wall_s: float) -> Path:
    """The report, the results and the plot into ``out``; the report's path."""
    png = out.figure(plot(rows, schemes), "flow.png")
    out.write(report(rows, schemes, seeds, wall_s, png), {
        "seeds": list(seeds), "dev_seeds": list(fs.DEV_SEEDS), "schemes": schemes,
        "wall_s": wall_s, "runs": rows, "analysis": analyse(rows, schemes)})
    return out.out / "report.md"
