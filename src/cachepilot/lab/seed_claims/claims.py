"""The seed-claims study's claims, each judged from the measured runs: the original's figure
against our mean and 95 % interval over seeds (:func:`cachepilot.lab.stats.ci95`; a relative
change between two positive measures as the geometric mean of the per-seed ratios,
:func:`cachepilot.lab.stats.paired_ratio`, so its interval cannot pass −100 %), weight
effects by paired log ratios shown in ms at the baseline's mean, adjusted together with
Holm's method (:func:`cachepilot.lab.stats.adjust`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cachepilot.lab.seed_claims.runs import LOAD_WEIGHTS, SATURATING_RATE, WEIGHT_FACTORS
from cachepilot.lab.stats import adjust, ci95, paired_ratio


# -- statistics -----------------------------------------------------------------------------------
def _rel(a: float, b: float) -> float:
    return (a - b) / b if b else float("nan")


def effect(a: list[float], b: list[float]) -> dict[str, Any]:
    """``a`` against ``b`` (seconds, paired by seed): the log-ratio test of
    :func:`~cachepilot.lab.stats.paired_ratio`, its change and interval also in seconds at
    ``b``'s mean (``mean``, ``lo``, ``hi``), which keeps them within the measure's bounds."""
    r = paired_ratio(a, b)
    base = float(np.mean(b)) if b else float("nan")
    return {**r, "log_mean": r["mean"], "mean": r["rel"] * base, "lo": r["rel_lo"] * base,
            "hi": r["rel_hi"] * base}


def relative(rows: list[dict], key: str, a: str, b: str) -> dict[str, float]:
    """The relative change of ``a`` over ``b`` in %, mean [95 % interval]: the geometric
    mean of the per-seed ratios when every value is positive; else (a count that can be 0,
    such as evictions) the mean of the per-seed changes with its t interval clipped at
    −100 %."""
    x, y = column(rows, a, key), column(rows, b, key)
    r = paired_ratio(x, y)
    if math.isfinite(r["rel"]):
        return {"mean": r["rel"] * 100, "lo": r["rel_lo"] * 100, "hi": r["rel_hi"] * 100,
                "n": r["n"], "p": r["p"], "how": "log ratio"}
    c = ci95([_rel(u, v) * 100 for u, v in zip(x, y, strict=True)])
    return {**c, "lo": max(c["lo"], -100.0), "how": "mean change, clipped"}


# -- the claims -----------------------------------------------------------------------------------
@dataclass
class Claim:
    id: str
    text: str
    original: float
    unit: str  # "%", "x", "s", "ms"
    values: list[float]
    note: str = ""
    stats: dict[str, float] = field(default_factory=dict)
    verdict: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # A relative change measured by :func:`relative` (the values are the per-seed changes).
    measured: dict[str, float] | None = None

    def judge(self) -> None:
        self.stats = self.measured or ci95(self.values)
        m, lo, hi = self.stats["mean"], self.stats["lo"], self.stats["hi"]
        o = self.original
        if not math.isfinite(m):
            self.verdict = "not measurable"
        elif lo <= o <= hi or (o != 0 and abs(m - o) <= 0.25 * abs(o)):
            self.verdict = "reproduced"
        elif self.unit != "%":  # an absolute level: say which side we are on
            self.verdict = "not reproduced: ours " + ("lower" if m < o else "higher")
        elif o != 0 and math.copysign(1, m) == math.copysign(1, o):
            self.verdict = ("same direction, weaker" if abs(m) < abs(o)
                            else "same direction, stronger")
        else:
            self.verdict = "not reproduced"


def rows_for(results: list[dict], workload: str) -> list[dict]:
    """One workload's task results, by seed (so paired values line up)."""
    return sorted((r for r in results if r["workload"] == workload), key=lambda r: r["seed"])


def column(rows: list[dict], variant: str, key: str) -> list[float]:
    """One variant's ``key`` in each row, in the rows' order."""
    return [r["runs"][variant][key] for r in rows]


def build_claims(results: list[dict]) -> tuple[list[Claim], dict[str, Any]]:
    """Every claim, judged, and what the report shows beside them (weight effects, sweeps)."""
    shared, sat, hot, bur = (rows_for(results, w)
                             for w in ("shared", "saturated", "hotspot", "bursty"))
    claims: list[Claim] = []
    extra: dict[str, Any] = {}

    def rel(rows, key, a="priced", b="round_robin"):
        return [_rel(r["runs"][a][key], r["runs"][b][key]) * 100 for r in rows]

    def change(rows, key, a="priced", b="round_robin"):
        return {"measured": relative(rows, key, a, b)}

    rr_hit = ci95(column(shared, "round_robin", "token_hit_rate"))["mean"]
    pr_hit = ci95(column(shared, "priced", "token_hit_rate"))["mean"]
    ws = np.mean([r["summary"]["shared_blocks"] for r in shared]) * 16
    cache = 8192 * 16
    c1note = (f"Round robin hits {rr_hit:.0%} of prompt tokens (priced {pr_hit:.0%}). The "
              f"blocks shared by more than one request total {ws / 1000:.0f}k tokens, "
              f"{ws / cache:.2f}× one worker's KV cache ({cache // 1000}k tokens), so a worker "
              "that sees every prefix still keeps most of them and round robin's median "
              "request is a hit too; the gap shows in the tail (p90 row) and grows with the "
              "working set (sensitivity rows: 2× and 4× the groups).")
    claims.append(Claim("1a", "Priced vs round robin, median TTFT (3 workers, 20 req/s, "
                        "shared prefixes)", -81.0, "%", rel(shared, "ttft_p50_s"), c1note,
                        **change(shared, "ttft_p50_s")))
    claims.append(Claim("1a-p90", "… same, p90 TTFT (not in the original)", float("nan"), "%",
                        rel(shared, "ttft_p90_s"), **change(shared, "ttft_p90_s")))
    for w, g in (("shared_x2", 96), ("shared_x4", 192)):
        rows = rows_for(results, w)
        if rows:
            claims.append(Claim(f"1a-{g}", f"… sensitivity: {g} prefix groups, median TTFT",
                                -81.0, "%", rel(rows, "ttft_p50_s"),
                                **change(rows, "ttft_p50_s")))
    sat_util = np.mean([np.mean(list(r["runs"]["round_robin"]["utilization"].values()))
                        for r in sat]) if sat else float("nan")
    claims.append(Claim("1b", f"Priced vs round robin, throughput once saturated "
                        f"({SATURATING_RATE:g} req/s offered)", 18.0, "%",
                        rel(sat, "throughput_rps"),
                        f"Round robin's workers are busy {sat_util:.0%} of the run, so both "
                        "policies run at capacity; the gain is the prefill the cache saves.",
                        **change(sat, "throughput_rps")))
    claims.append(Claim("1c", "Priced vs round robin, evictions", -42.0, "%",
                        rel(shared, "evictions"),
                        "Evictions are block reuses in the engine's KV cache; when priced "
                        "partitions the prefixes, each worker's share fits and almost nothing "
                        "is evicted, so the relative drop is close to −100%.",
                        **change(shared, "evictions")))
    claims.append(Claim("2a", "Overlap-only on a hotspot: imbalance (max/mean assigned)", 3.0,
                        "x", column(hot, "overlap_only", "imbalance_assigned"),
                        "Every hotspot request starts with the same system prompt, so the first "
                        "worker to see it always has the longest match and takes everything."))
    op50 = column(hot, "overlap_only", "ttft_p50_s")
    pp50 = column(hot, "priced", "ttft_p50_s")
    claims.append(Claim("2b", "Overlap-only on the hotspot: median TTFT (s)", 35.0, "s", op50,
                        "How far the one hot worker falls behind depends on how far the offered "
                        "load exceeds one worker's capacity and for how long: here 20 req/s of "
                        "mostly cached prompts for 60 s, so its queue grows for a minute. The "
                        "original's 35 s implies a deeper overload or a longer run."))
    claims.append(Claim("2c", "Priced (with load terms) on the hotspot: median TTFT (ms)",
                        219.0, "ms", [x * 1000 for x in pp50],
                        "Our engine model serves a cached prompt in one ~15–30 ms step; the "
                        "original's 219 ms includes costs we do not model (HTTP, tokenization, "
                        "a slower GPU step)."))
    claims.append(Claim("2d", "… overlap-only with the gateway's admission limit (128 waiting) "
                        "in place: imbalance", 3.0, "x",
                        column(hot, "overlap_only+admission128", "imbalance_assigned"),
                        "Not in the original: CachePilot's admission filter spills requests "
                        "once a worker's scraped queue reaches 128; the largest queue any scrape "
                        "saw here was "
                        f"{max(column(hot, 'overlap_only+admission128', 'max_waiting_scraped'))}"
                        " (the engine runs up to 64 requests at once and queues the rest)."))
    claims.append(Claim("3", "Priced on the hotspot: imbalance (max/mean assigned)", 1.05, "x",
                        column(hot, "priced", "imbalance_assigned")))

    # 4: seed variance against weight effects, on the shared-prefix workload, paired by seed.
    base = column(shared, "priced", "ttft_p50_s")
    seed_sd = ci95(base)["sd"]
    effects = {}
    for k in ("prefill", "load", "kv"):
        for f in WEIGHT_FACTORS:
            effects[f"{k}×{f:g}"] = effect(column(shared, f"{k}x{f:g}", "ttft_p50_s"), base)
    extra["seed_vs_weight"] = {"seed_sd_s": seed_sd, "effects": effects, "workload": "shared"}

    # 5: does the best load weight flip between regimes? Only a paired, significant ordering
    # counts: a weight that beats unit weight in one regime and loses to it in the other.
    sweeps: dict[str, dict[str, Any]] = {}
    for regime, rows in (("bursty", bur), ("hotspot", hot)):
        base5 = column(rows, "priced", "ttft_p50_s")
        curve = {}
        for w in LOAD_WEIGHTS:
            name = "priced" if w == 1.0 else f"load={w:g}"
            curve[w] = {"p50": ci95(column(rows, name, "ttft_p50_s")),
                        "p90": ci95(column(rows, name, "ttft_p90_s")),
                        "vs_unit": (effect(column(rows, name, "ttft_p50_s"), base5)
                                    if w != 1.0 else {})}
        sweeps[regime] = {"curve": curve}
    # One family: the weight effects and the load-weight sweeps (Holm).
    family = [*effects.values(), *(c["vs_unit"] for sw in sweeps.values()
                                    for c in sw["curve"].values() if c["vs_unit"])]
    adjust(family)
    extra["family"] = {"tests": len(family),
                       "significant_raw": sum(t["significant"] for t in family),
                       "significant_holm": sum(t["significant_holm"] for t in family)}
    significant = [k for k, e in effects.items() if e["significant_holm"]]
    significant_raw = [k for k, e in effects.items() if e["significant"]]
    claims.append(Claim(
        "4", "Weight changes (×0.5, ×2 on prefill, load, kv) with a significant paired effect "
        "on median TTFT (of 6; Holm over this claim's and claim 5's 20 tests)", float("nan"),
        "n", [float(len(significant))],
        f"Significant before adjustment: {len(significant_raw)}. Seed-to-seed SD of the "
        f"median: {seed_sd * 1000:.2f} ms. Paired changes, variant / unit weights (log "
        "ratios), in ms at unit weight's mean, [95% CI]: "
        + "; ".join(f"{k} {e['mean'] * 1000:+.2f} [{e['lo'] * 1000:+.2f}, "
                    f"{e['hi'] * 1000:+.2f}]" for k, e in effects.items())))
    claims[-1].extra["original_text"] = "the seed mattered more than most weight changes"
    tested = [w for w in LOAD_WEIGHTS if w != 1.0]
    for regime, sw in sweeps.items():
        curve = sw["curve"]

        def picked(holm: bool, lower: bool, curve: dict = curve) -> list[float]:
            key = "significant_holm" if holm else "significant"
            return [w for w in tested if curve[w]["vs_unit"][key]
                    and (curve[w]["vs_unit"]["mean"] < 0) == lower]

        better, worse = picked(True, True), picked(True, False)
        sw.update({"curve": {str(k): v for k, v in curve.items()},
                   "better_than_unit": better, "worse_than_unit": worse,
                   "better_than_unit_raw": picked(False, True),
                   "worse_than_unit_raw": picked(False, False)})
        claims.append(Claim(
            f"5-{regime}", f"Load weights significantly better than unit weight under {regime} "
            "traffic (paired, median TTFT, Holm)", float("nan"), "n", [float(len(better))],
            ("better: " + (", ".join(f"{w:g}" for w in better) or "none") + "; worse: "
             + (", ".join(f"{w:g}" for w in worse) or "none") + " (before adjustment: "
             f"better {', '.join(f'{w:g}' for w in sw['better_than_unit_raw']) or 'none'}, "
             f"worse {', '.join(f'{w:g}' for w in sw['worse_than_unit_raw']) or 'none'}). "
             "Curve in weight_sweep.png.")))
    extra["sweeps"] = sweeps
    flips = sorted((set(sweeps["bursty"]["better_than_unit"])
                    & set(sweeps["hotspot"]["worse_than_unit"]))
                   | (set(sweeps["hotspot"]["better_than_unit"])
                      & set(sweeps["bursty"]["worse_than_unit"])))
    extra["flipping_weights"] = flips
    for c in claims:
        c.judge()
    for c in claims:
        if c.id.startswith("5-"):
            c.verdict = (f"flips: {', '.join(f'{w:g}' for w in flips)} beat unit weight in one "
                         "regime and lose in the other" if flips else
                         "no flip: no weight beats unit weight in one regime and loses in the "
                         "other")
        if c.id == "4":
            c.verdict = ("reproduced (most weight changes have no significant effect)"
                         if len(significant) <= 2 else
                         "not reproduced (most weight changes have a significant effect)")
        if c.id == "1a-p90":
            c.verdict = "—"
    return claims, extra
