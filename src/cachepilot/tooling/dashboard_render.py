"""Render the Grafana dashboard (charts/cachepilot/files/grafana-dashboard.json) from a real
run: the local stack (sim workers + Envoy + gateway) under prefix-sharing load, a real
Prometheus scraping the gateway's /metrics every second, every panel's PromQL evaluated by
that Prometheus over the run, drawn with matplotlib in the dashboard's layout.

    python -m cachepilot.tooling.dashboard_render --out docs/observability

writes ``dashboard.png`` and ``dashboard-data.json`` (every query, as sent, and the series
Prometheus answered) there. No Grafana server installs from PyPI, npm or Debian here, so the
picture is ours; the queries are the dashboard's own, run by Prometheus (Debian's
``prometheus`` package: :mod:`cachepilot.tooling.prometheus`). Grafana's template variables
are substituted as Grafana would: ``$pool`` → ``.*`` (All), ``$__rate_interval`` → the
``--rate-interval`` given (Grafana's is max(4 × scrape interval, step + scrape interval)).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from cachepilot.sim.workloads import Dist, WorkloadSpec, generate
from cachepilot.tooling.demo import MODEL, WORKER_KV_BLOCKS
from cachepilot.tooling.loadgen import chat_body, run, summarize
from cachepilot.tooling.prometheus import Prometheus
from cachepilot.tooling.stack import LocalStack, StackConfig

DASHBOARD = Path(__file__).resolve().parents[3] / "charts/cachepilot/files/grafana-dashboard.json"
_LEGEND_RE = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    return json.loads(path.read_text())


def panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel with queries, rows flattened, in layout order (top to bottom, left to
    right)."""
    out: list[dict[str, Any]] = []
    for p in dash.get("panels", []):
        out += [p, *p.get("panels", [])] if p.get("type") == "row" else [p]
    out = [p for p in out if p.get("targets")]
    return sorted(out, key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))


def substitute(expr: str, *, pool: str = ".*", rate_interval: str = "15s") -> str:
    """Grafana's template variables as a dashboard showing every pool would send them."""
    return (expr.replace("$__rate_interval", rate_interval).replace("${pool}", pool)
            .replace("$pool", pool))


def legend(fmt: str, labels: dict[str, str]) -> str:
    if not fmt:
        return "{" + ", ".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"
    return _LEGEND_RE.sub(lambda m: labels.get(m.group(1), ""), fmt)


# -- the run ----------------------------------------------------------------------------------
async def _bad_requests(url: str, duration_s: float, every_s: float, sent: list[int]) -> None:
    """A malformed request (400) and one for a model nobody serves (404) every ``every_s``:
    the errors panel shows the gateway's own replies by code."""
    async with aiohttp.ClientSession() as s:
        start = time.monotonic()
        while time.monotonic() - start < duration_s:
            for body in ({"model": MODEL}, {"model": "no-such-model", "prompt": "x"}):
                async with s.post(f"{url}/v1/completions", json=body) as r:
                    await r.read()
                    sent.append(r.status)
            await asyncio.sleep(every_s)


async def _load(url: str, spec: WorkloadSpec, seed: int, progress: Any,
                bad: list[int]) -> tuple[list[Any], float]:
    reqs = generate(spec, seed).requests
    bodies = [chat_body(r, MODEL) for r in reqs]
    errors = asyncio.create_task(_bad_requests(url, spec.duration, 10.0, bad))
    try:
        return await run(url, [r.arrival for r in reqs], bodies, progress)
    finally:
        await errors


def run_and_query(*, duration_s: float, rate: float, workers: int, seed: int,
                  rate_interval: str, dash: dict[str, Any], log: Any = print) -> dict[str, Any]:
    """Start the stack and Prometheus, run the load, then evaluate every panel's queries over
    the run. Returns the measured series and what was run."""
    spec = WorkloadSpec("shared_prefix", rate=rate, duration=duration_s, groups=32,
                        prefix=Dist(4000), suffix=Dist(100), output=Dist(32))
    config = StackConfig(workers=workers, policy="priced", model=MODEL,
                         worker_args=("--num-blocks", str(WORKER_KV_BLOCKS)))
    log(f"starting the local stack ({workers} sim workers, Envoy, gateway) …")
    with LocalStack(config) as stack:
        admin = stack.admin_url.removeprefix("http://")
        log(f"gateway admin {stack.admin_url}; starting Prometheus (scrape every 1 s) …")
        with Prometheus([admin], scrape_interval_s=1.0,
                        log_dir=stack.log_dir / "prometheus") as prom:
            prom.wait_scraped()
            log(f"Prometheus at {prom.url}; load: {rate:g} req/s for {duration_s:g} s, "
                f"32 shared prompts of ~4,000 tokens")
            done = [0, 0]
            bad: list[int] = []

            def progress(n: int, total: int) -> None:
                done[0], done[1] = n, total

            stop = threading.Event()

            def ticker() -> None:
                t0 = time.monotonic()
                while not stop.wait(5.0):
                    try:
                        up = prom.query("scrape_samples_scraped")
                        samples = up[0]["value"][1] if up else "?"
                    except Exception:  # progress only: never fail the run for it
                        samples = "?"
                    log(f"  {time.monotonic() - t0:5.0f} s  answered {done[0]}/{done[1] or '?'}"
                        f"  bad requests {len(bad)}  series in last scrape {samples}")

            tick = threading.Thread(target=ticker, daemon=True)
            tick.start()
            start = time.time()
            try:
                results, wall = asyncio.run(_load(stack.url, spec, seed, progress, bad))
            finally:
                stop.set()
                tick.join()
            time.sleep(3.0)  # the last scrapes after the last answer
            end = time.time()
            summary = summarize(results, wall)
            log(f"load done: {summary['requests']} requests, {summary['errors']} errors, "
                f"TTFT p50 {summary['ttft_p50_s'] * 1000:.0f} ms; querying {len(panels(dash))} "
                "panels …")
            # Prometheus' own record of each scrape: 0 where one failed or timed out (1 s)
            up = prom.query_range(f'up{{job="{prom.job}"}}', start, end, 1.0)
            missed = sum(v[1] == "0" for s in up for v in s["values"])
            log(f"scrapes missed (up == 0) over the run: {missed}")
            out_panels = []
            for p in panels(dash):
                targets = []
                for t in p["targets"]:
                    expr = substitute(t["expr"], rate_interval=rate_interval)
                    series = prom.query_range(expr, start, end, 1.0)
                    targets.append({"refId": t.get("refId"), "expr": t["expr"], "sent": expr,
                                    "legendFormat": t.get("legendFormat", ""),
                                    "series": series})
                out_panels.append({"title": p["title"], "type": p["type"],
                                   "unit": p.get("fieldConfig", {}).get("defaults", {})
                                   .get("unit", ""), "targets": targets})
    return {"measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "commit": _commit(), "start": start, "end": end, "rate_interval": rate_interval,
            "workload": {"rate": rate, "duration_s": duration_s, "groups": 32,
                         "prefix_tokens": 4000, "suffix_tokens": 100, "output_tokens": 32,
                         "seed": seed, "workers": workers, "policy": "priced",
                         "worker_kv_blocks": WORKER_KV_BLOCKS,
                         "bad_requests": len(bad)},
            "summary": {k: v for k, v in summary.items() if not isinstance(v, (list, dict))},
            "scrape_up": up,
            "panels": out_panels}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


# -- the picture ------------------------------------------------------------------------------
_BG, _PANEL, _TEXT, _GRID = "#111217", "#181b1f", "#ccccdc", "#2c3235"
_MODE_COLORS = {"exact": "#73bf69", "degraded": "#fade2a", "approximate": "#5794f2"}


def draw(data: dict[str, Any], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, PercentFormatter

    ps = data["panels"]
    rows = (len(ps) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(16, 3.3 * rows + 1.0), facecolor=_BG)
    start = data["start"]
    for ax, p in zip(axes.flat, ps, strict=False):
        ax.set_facecolor(_PANEL)
        ax.set_title(p["title"], color=_TEXT, fontsize=10, loc="left")
        ax.tick_params(colors=_TEXT, labelsize=8)
        for s in ax.spines.values():
            s.set_color(_GRID)
        ax.grid(color=_GRID, linewidth=0.5)
        n = 0
        if p["type"] == "state-timeline":
            n = _state_timeline(ax, p, start)
        else:
            for t in p["targets"]:
                for s in t["series"]:
                    xs = [float(v[0]) - start for v in s["values"]]
                    ys = [float(v[1]) for v in s["values"]]
                    # the first series widest: one that another overlaps stays visible
                    ax.plot(xs, ys, linewidth=max(1.0, 2.6 - 0.5 * n),
                            label=legend(t["legendFormat"], s["metric"]))
                    n += 1
            unit = p["unit"]
            if unit == "percentunit":
                ax.yaxis.set_major_formatter(PercentFormatter(1.0))
                ax.set_ylim(0, 1.05)
            elif unit == "s":
                ax.yaxis.set_major_formatter(FuncFormatter(_seconds))
            elif unit == "reqps":
                ax.set_ylabel("per second", color=_TEXT, fontsize=8)
            if n:
                ax.set_ylim(bottom=0)
                ax.legend(fontsize=7, facecolor=_PANEL, edgecolor=_GRID, labelcolor=_TEXT,
                          loc="upper left", ncols=2)
        if not n:
            ax.text(0.5, 0.5, "No data", transform=ax.transAxes, ha="center", va="center",
                    color=_TEXT, fontsize=11)
        ax.set_xlim(0, data["end"] - start)
        ax.set_xlabel("seconds since the load started", color=_TEXT, fontsize=8)
    for ax in list(axes.flat)[len(ps):]:
        ax.set_visible(False)
    w = data["workload"]
    fig.suptitle(f"CachePilot gateway — dashboard queries evaluated by Prometheus over a real "
                 f"run ({w['workers']} sim workers, {w['rate']:g} req/s for "
                 f"{w['duration_s']:g} s, policy {w['policy']}; {data['measured_at']}, "
                 f"commit {data['commit']}; $__rate_interval={data['rate_interval']})",
                 color=_TEXT, fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90, facecolor=_BG)
    plt.close(fig)


def _seconds(v: float, _pos: object) -> str:
    if v == 0:
        return "0"
    if abs(v) < 0.01:
        return f"{v * 1000:.2g} ms"
    return f"{v * 1000:.0f} ms" if abs(v) < 1 else f"{v:.2g} s"


def _state_timeline(ax: Any, p: dict[str, Any], start: float) -> int:
    """Rows per worker, coloured by the mode whose series is 1 (the query keeps only those)."""
    rows: dict[str, list[tuple[float, str]]] = {}
    for t in p["targets"]:
        for s in t["series"]:
            worker, mode = s["metric"].get("worker", "?"), s["metric"].get("mode", "?")
            rows.setdefault(worker, []).extend((float(v[0]) - start, mode) for v in s["values"])
    for i, (_worker, points) in enumerate(sorted(rows.items())):
        for x, mode in points:
            ax.broken_barh([(x - 0.5, 1.0)], (i - 0.4, 0.8),
                           color=_MODE_COLORS.get(mode, "#b877d9"))
    ax.set_yticks(range(len(rows)), sorted(rows), fontsize=8)
    seen = {m for pts in rows.values() for _, m in pts}
    for m in sorted(seen):
        ax.barh([], [], color=_MODE_COLORS.get(m, "#b877d9"), label=m)
    if seen:
        ax.legend(fontsize=7, facecolor=_PANEL, edgecolor=_GRID, labelcolor=_TEXT,
                  loc="upper right")
    ax.grid(False)
    return len(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cachepilot.tooling.dashboard_render",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("docs/observability"))
    ap.add_argument("--dashboard", type=Path, default=DASHBOARD)
    ap.add_argument("--duration", type=float, default=75.0, help="seconds of load")
    ap.add_argument("--rate", type=float, default=8.0, help="requests per second")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--rate-interval", default="15s",
                    help="what $__rate_interval becomes (Prometheus duration)")
    ap.add_argument("--from-data", type=Path, default=None,
                    help="redraw from a dashboard-data.json instead of running")
    args = ap.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.from_data:
        data = json.loads(args.from_data.read_text())
    else:
        data = run_and_query(duration_s=args.duration, rate=args.rate, workers=args.workers,
                             seed=args.seed, rate_interval=args.rate_interval,
                             dash=load_dashboard(args.dashboard), log=log)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "dashboard-data.json").write_text(json.dumps(data, indent=1))
    png = args.out / "dashboard.png"
    draw(data, png)
    log(f"wrote {png}" + ("" if args.from_data else f" and {args.out / 'dashboard-data.json'}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
