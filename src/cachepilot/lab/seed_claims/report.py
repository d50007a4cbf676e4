"""The seed-claims study's report.md, its tables and the writing of its folder."""

from __future__ import annotations

import math
from typing import Any

from cachepilot.lab.output import StudyOutput, seeds_phrase
from cachepilot.lab.seed_claims import plots, runs
from cachepilot.lab.seed_claims.claims import Claim, build_claims, column, rows_for
from cachepilot.lab.stats import ci95


def _fmt(x: float, unit: str) -> str:
    if x is None or not math.isfinite(x):
        return "—"
    if unit == "%":
        return f"{x:+.1f}%"
    if unit == "s":
        return f"{x:.2f} s"
    if unit == "ms":
        return f"{x:.1f} ms"
    if unit == "x":
        return f"{x:.2f}"
    return f"{x:g}"


def _ours(stats: dict[str, float], unit: str) -> str:
    if not stats or not stats.get("n"):
        return "—"
    if stats["n"] == 1 or stats["lo"] == stats["hi"]:
        return _fmt(stats["mean"], unit)
    return f"{_fmt(stats['mean'], unit)} [{_fmt(stats['lo'], unit)}, {_fmt(stats['hi'], unit)}]"


def _ms(stats: dict[str, float]) -> dict[str, float]:
    return {k: (v * 1000 if k in ("mean", "lo", "hi", "sd") else v) for k, v in stats.items()}


def _diff(c: Claim) -> str:
    m, o = c.stats.get("mean"), c.original
    if m is None or not math.isfinite(m) or not math.isfinite(o):
        return ""
    if c.unit == "%":
        return f"{m - o:+.1f} points"
    if o:
        return f"{(m - o) / abs(o):+.0%}"
    return ""


def render(claims: list[Claim], extra: dict[str, Any], tables: dict[str, Any],
           speed: dict[str, Any], figs: dict[str, str]) -> str:
    L = ["# CachePilot seed claims, re-measured", ""]
    L.append(f"{seeds_phrase(speed['seeds'])}: {speed['runs']} simulated runs, "
             f"{speed['simulated_requests']:,} simulated requests in {speed['wall_s']:.0f} s "
             f"on {speed['processes']} processes: **{speed['sim_requests_per_wall_s']:,.0f} "
             f"simulated requests per wall second** "
             f"({speed['sim_requests_per_cpu_s']:,.0f} per CPU second).")
    L.append("")
    L.append("Ours = mean over seeds with a 95% Student-t interval; a relative change "
             "between two policies is the geometric mean of the per-seed ratios, its interval "
             "a t interval on the log ratios (it cannot pass −100 %; evictions, which can be "
             "0, use the mean per-seed change with its interval clipped at −100 %). "
             "Parameters were fixed before measuring (docs/simulator.md); none were fitted to "
             "the original figures. Verdict: *reproduced* when the original lies in our "
             "interval or within 25% of our mean; otherwise the direction is compared. "
             f"Weight effects (claims 4 and 5): {extra['family']['tests']} paired tests "
             "adjusted together with Holm's method: "
             f"**{extra['family']['significant_holm']} significant after adjustment**, "
             f"{extra['family']['significant_raw']} before.")
    L.append("")
    L.append("| # | Claim | Original | Ours (mean [95% CI]) | Verdict | Difference | Why |")
    L.append("|---|---|---|---|---|---|---|")
    for c in claims:
        orig = c.extra.get("original_text") or _fmt(c.original, c.unit)
        if c.id.startswith("5-"):
            orig = "only the load weight mattered; its best value flipped between regimes"
        L.append(f"| {c.id} | {c.text} | {orig} | {_ours(c.stats, c.unit)} | {c.verdict} | "
                 f"{_diff(c)} | {c.note} |")
    L += ["", "## Policies", ""]
    for wl in ("shared", "hotspot", "bursty"):
        t = tables.get(wl) or {}
        if not t:
            continue
        ideal = next(iter(t.values()))["ideal_p50_s"]["mean"] * 1000
        L.append(f"### {wl} (ideal median TTFT: {ideal:.1f} ms)")
        L.append("")
        L.append("| policy | p50 ms | p90 ms | p99 ms | p50/ideal | hit rate | evictions "
                 "| imbalance (req) | imbalance (busy) | req/s |")
        L.append("|---|---|---|---|---|---|---|---|---|---|")
        for p, s in t.items():
            L.append(f"| {p} | {s['ttft_p50_s']['mean'] * 1000:.1f} | "
                     f"{s['ttft_p90_s']['mean'] * 1000:.1f} | {s['ttft_p99_s']['mean'] * 1000:.0f}"
                     f" | {s['p50_over_ideal']['mean']:.2f} | {s['token_hit_rate']['mean']:.3f} | "
                     f"{s['evictions']['mean']:.0f} | {s['imbalance_assigned']['mean']:.2f} | "
                     f"{s['imbalance_busy']['mean']:.2f} | {s['throughput_rps']['mean']:.2f} |")
        L.append("")
    sat = tables.get("saturated") or {}
    if sat:
        L.append("### saturated (shared prefixes offered at 3× the rate)")
        L.append("")
        L.append("| policy | req/s | output tok/s | hit rate |")
        L.append("|---|---|---|---|")
        for p, s in sat.items():
            L.append(f"| {p} | {_ours(s['throughput_rps'], 'x')} | "
                     f"{s['throughput_out_tps']['mean']:.0f} | {s['token_hit_rate']['mean']:.3f} |")
        L.append("")
    L += ["## Load-weight sweep, paired against unit weight", "",
          "Each row: the median TTFT with that load weight, and its paired change from "
          "unit weight over the same seeds (the geometric mean of the per-seed ratios, in ms "
          "at unit weight's mean, [95% CI]); **bold** where it is significant after Holm's "
          "adjustment, \"(raw)\" where only before.", ""]
    L.append("| regime | load weight | median TTFT | − unit weight |")
    L.append("|---|---|---|---|")
    for regime, s in extra["sweeps"].items():
        for w, c in s["curve"].items():
            d = c["vs_unit"]
            diff = (f"{d['mean'] * 1000:+.2f} [{d['lo'] * 1000:+.2f}, {d['hi'] * 1000:+.2f}] ms"
                    if float(w) != 1.0 else "—")
            if d.get("significant_holm"):
                diff = f"**{diff}**"
            elif d.get("significant"):
                diff = f"{diff} (raw)"
            L.append(f"| {regime} | {float(w):g} | {_ours(_ms(c['p50']), 'ms')} | {diff} |")
    L.append("")
    st = extra.get("staleness") or {}
    if st:
        L += ["## Stale metrics (priced, hotspot)", "",
              "| variant (default scrape 0.1 s) | p50 | p90 | imbalance |", "|---|---|---|---|"]
        for v, s in st.items():
            L.append(f"| {v} | {_ours(_ms(s['ttft_p50_s']), 'ms')} | "
                     f"{_ours(_ms(s['ttft_p90_s']), 'ms')} | "
                     f"{_ours(s['imbalance_assigned'], 'x')} |")
        L.append("")
    L += ["## Plots", ""]
    for name, f in figs.items():
        L.append(f"![{name}]({f})")
    L.append("")
    return "\n".join(L)


def policy_table(results: list[dict], workload: str) -> dict[str, dict[str, Any]]:
    rows = rows_for(results, workload)
    out = {}
    for p in runs.ALL_POLICIES:
        if not rows or p not in rows[0]["runs"]:
            continue
        out[p] = {k: ci95(column(rows, p, k)) for k in
                  ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "throughput_rps",
                   "throughput_out_tps", "token_hit_rate", "evictions", "imbalance_assigned",
                   "imbalance_busy", "p50_over_ideal")}
        out[p]["ideal_p50_s"] = ci95([r["ideal_p50_s"] for r in rows])
    return out


def write_outputs(data: dict[str, Any], output: StudyOutput
                  ) -> tuple[list[Claim], dict[str, Any]]:
    """The claims, the policy tables, the plots, report.md and results.json."""
    claims, extra = build_claims(data["results"])
    tables = {w: policy_table(data["results"], w) for w in ("shared", "hotspot", "bursty")}
    sat = rows_for(data["results"], "saturated")
    tables["saturated"] = {p: {k: ci95(column(sat, p, k)) for k in
                               ("throughput_rps", "throughput_out_tps", "token_hit_rate")}
                           for p in ("round_robin", "priced")} if sat else {}
    stale = rows_for(data["results"], "hotspot")
    extra["staleness"] = {v: {k: ci95(column(stale, v, k)) for k in
                              ("ttft_p50_s", "ttft_p90_s", "imbalance_assigned")}
                          for v in ("priced", "priced@scrape1s", "priced@scrape4s")}
    doc = {
        "setup": {"workers": runs.WORKERS, "rate": runs.RATE,
                  "saturating_rate": runs.SATURATING_RATE, "duration_s": runs.DURATION,
                  "load_weights": runs.LOAD_WEIGHTS,
                  "workloads": {k: v.to_dict() for k, v in runs.WORKLOADS.items()},
                  "cost": runs.STUDY_COST.to_dict()},
        "speed": {k: data[k] for k in ("wall_s", "processes", "seeds", "simulated_requests",
                                       "sim_requests_per_wall_s", "sim_requests_per_cpu_s",
                                       "runs")},
        "claims": [{"id": c.id, "claim": c.text, "original": c.original, "unit": c.unit,
                    "values": c.values, "ours": c.stats, "verdict": c.verdict, "note": c.note,
                    **c.extra} for c in claims],
        "policies": tables,
        "extra": extra,
    }
    figs = plots.make_all(data["results"], extra, tables, output)
    output.write(render(claims, extra, tables, doc["speed"], figs), doc)
    return claims, doc
