"""Live scrapes of the gateway's /metrics for the metric tests (test_metrics_*.py), taken once
per test session, and the naming lint they are checked with.

* ``stack_scrapes()``: the local stack (2 sim workers, Envoy, the gateway with a decision log)
  scraped after a first wave of routed requests (streamed, prefix-sharing) and bad requests,
  and again after a second wave.
* ``kv_event_scrape()``: an in-process gateway following a KV-event publisher that drops a
  batch (a gap, filled by replay) and sends a garbage frame.
"""

from __future__ import annotations

import asyncio
import functools
import re
import tempfile
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from cachepilot.core.cost import Weights
from cachepilot.core.fingerprint import BlockConfig
from cachepilot.core.kv_events import BlockStored
from cachepilot.core.router import static_router
from cachepilot.datalayer.kv_events import port_endpoints
from cachepilot.gateway.server import Gateway, GatewayConfig
from cachepilot.sim.workloads import Dist, WorkloadSpec, generate
from cachepilot.tooling.kv_event_publisher import KVEventPublisher
from cachepilot.tooling.loadgen import chat_body, run
from cachepilot.tooling.stack import LocalStack, StackConfig, free_port_pair

from helpers.polling import eventually, until

MODEL = "sim-llama-8b"
KV_WORKER = "127.0.0.1:1"  # nothing listens (its scrapes fail): only its events matter


@dataclass
class Family:
    name: str  # as the parser gives it: counters without _total
    type: str
    help: str
    samples: list[Sample]

    @property
    def label_names(self) -> set[str]:
        return {k for s in self.samples for k in s.labels if k not in ("le", "quantile")}

    def value(self, suffix: str = "", **labels: str) -> float:
        """Sum of the samples named ``name + suffix`` whose labels include ``labels``."""
        return sum(s.value for s in self.samples if s.name == self.name + suffix
                   and all(s.labels.get(k) == v for k, v in labels.items()))


def parse(text: str) -> dict[str, Family]:
    return {f.name: Family(f.name, f.type, f.documentation, list(f.samples))
            for f in text_string_to_metric_families(text)}


@dataclass
class StackScrapes:
    first: str
    second: str
    workers: list[str]


def _wave(url: str, seed: int, duration: float) -> None:
    spec = WorkloadSpec("shared_prefix", rate=6.0, duration=duration, groups=3,
                        prefix=Dist(800), suffix=Dist(40), output=Dist(6))
    reqs = generate(spec, seed).requests
    results, _ = asyncio.run(run(url, [r.arrival for r in reqs],
                                 [chat_body(r, MODEL) for r in reqs]))
    assert results and all(r.ok for r in results), [r.error for r in results if not r.ok]


@functools.cache
def stack_scrapes() -> StackScrapes:
    log = tempfile.mkdtemp(prefix="cachepilot-metrics-test-")
    with LocalStack(StackConfig(workers=2, model=MODEL, decision_log=f"{log}/decisions")) as st:
        _wave(st.url, 1, 2.0)
        with httpx.Client(timeout=30) as c:
            assert c.post(f"{st.url}/v1/completions", json={"model": MODEL}).status_code == 400
            assert c.post(f"{st.url}/v1/chat/completions",  # (an unparseable body goes
                          json={"model": MODEL, "messages": "x"}).status_code == 400  # by load)
            first = c.get(f"{st.admin_url}/metrics").text
            _wave(st.url, 2, 2.0)
            assert c.post(f"{st.url}/v1/completions", json={"model": MODEL}).status_code == 400
            wave_end = time.time()

            def after_the_wave() -> str | None:
                """The scrape once every worker's load was scraped after the wave and
                nothing is in flight (every end observed)."""
                workers = c.get(f"{st.admin_url}/workers").json()
                if not all((w["scraped_at"] or 0) > wave_end for w in workers):
                    return None
                text = c.get(f"{st.admin_url}/metrics").text
                in_flight = parse(text)["cachepilot_worker_requests_in_flight"]
                return None if any(in_flight.value(worker=w["address"]) for w in workers) \
                    else text

            second = until(after_the_wave, timeout=30,
                           what="a scrape of every worker after the wave, nothing in flight")
        return StackScrapes(first, second, list(st.worker_addresses))


@functools.cache
def kv_event_scrape() -> str:
    return asyncio.run(_kv_event_scrape())


async def _kv_event_scrape() -> str:
    port = free_port_pair()
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}")
    router = static_router([KV_WORKER], policy="priced", weights=Weights(), models=(),
                           block=BlockConfig(16), capacity_blocks=1000, engine="vllm")
    gw = Gateway(router, GatewayConfig(grpc_address="127.0.0.1:0", admin_port=0,
                                       stall_after_s=0,
                                       kv_endpoints=port_endpoints(port, port + 1, "kv-events")))
    await gw.start()
    try:
        directory = router.pools["default"].directory

        def arrived() -> bool:
            if directory.match([11, 12, 13], [KV_WORKER])[KV_WORKER] == 3:
                return True
            pub.publish([])  # heartbeat-like traffic until the subscription is up
            return False

        pub.publish([BlockStored((11, 12, 13))])
        # A busy machine: subscription, gap, replay.
        await eventually(arrived, timeout=30, interval=0.1, retry_on=(),
                         what="the events reaching the directory")
        pub.drop_next(1)  # numbered and buffered, never sent live: a gap only replay fills
        pub.publish([BlockStored((21,))])
        pub.publish([BlockStored((22,), parent=21)])
        # the topic and a sequence number, then a payload msgpack cannot decode
        pub.publish_raw([b"kv-events", (1 << 40).to_bytes(8, "big"), b"\xc1garbage"])
        async with httpx.AsyncClient(timeout=10) as c:
            url = f"http://127.0.0.1:{gw.admin_port}/metrics"

            async def replayed() -> str:
                text = (await c.get(url)).text
                fams = parse(text)
                assert (fams["cachepilot_kv_event_replays"].value("_total") >= 1
                        and fams["cachepilot_kv_event_malformed_frames"].value("_total") >= 1
                        and directory.match([21, 22], [KV_WORKER])[KV_WORKER] == 2
                        and directory.mode(KV_WORKER) == "exact"), text
                return text

            return await eventually(replayed, timeout=30, interval=0.1,
                                    what="the gap replayed and the garbage frame counted")
    finally:
        await gw.stop()
        pub.close()


# -- the naming lint ------------------------------------------------------------------------
# https://prometheus.io/docs/practices/naming/ and promtool's own lint (promlint).
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_ABBREVIATED_UNITS = ("_ms", "_us", "_ns", "_msec", "_usec", "_millis", "_milliseconds",
                      "_microseconds", "_nanoseconds", "_minutes", "_hours", "_days", "_perc",
                      "_percent", "_pct", "_kb", "_mb", "_gb", "_kib", "_mib", "_gib",
                      "_kilobytes", "_megabytes", "_gigabytes", "_bits")
_TIME_WORDS = ("latency", "duration", "ttft", "time", "delay")
_UNBOUNDED_LABELS = {"id", "decision", "decision_id", "request", "request_id", "prompt", "hash",
                     "block", "prefix", "user", "url", "path", "trace_id"}


def lint(fams: dict[str, Family], *, prefix: str = "cachepilot_",
         max_series_per_family: int = 200) -> list[str]:
    """Problems with the exported families' names, types, units and labels."""
    problems = []
    for name, f in sorted(fams.items()):
        where = f"{name} ({f.type})"
        if not name.startswith(prefix):
            problems.append(f"{where}: not under the {prefix} namespace")
        if not _NAME_RE.match(name):
            problems.append(f"{where}: not snake_case")
        if not f.help.strip():
            problems.append(f"{where}: no HELP text")
        if any(u in f"{name}_" for u in (u + "_" for u in _ABBREVIATED_UNITS)):
            problems.append(f"{where}: an abbreviated or non-base unit in the name")
        if f.type == "counter":
            names = {s.name for s in f.samples}
            if names - {name + "_total", name + "_created"} or name.endswith("_total"):
                problems.append(f"{where}: counter samples must be {name}_total")
        elif name.endswith("_total"):
            problems.append(f"{where}: _total is for counters only")
        if f.type in ("histogram", "summary"):
            timed = any(w in name for w in _TIME_WORDS)
            if timed and not name.endswith("_seconds"):
                problems.append(f"{where}: a duration histogram must end in _seconds")
        if f.type == "gauge" and "usage" in name and not name.endswith("_ratio"):
            problems.append(f"{where}: a 0-1 usage gauge must end in _ratio")
        if f.type == "unknown" or f.type == "untyped":
            problems.append(f"{where}: untyped")
        for label in f.label_names:
            if not _NAME_RE.match(label) or label.startswith("__"):
                problems.append(f"{where}: bad label name {label!r}")
            if label in _UNBOUNDED_LABELS:
                problems.append(f"{where}: label {label!r} has unbounded cardinality")
        series = {tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
                  for s in f.samples}
        if len(series) > max_series_per_family:
            problems.append(f"{where}: {len(series)} series (cardinality)")
    return problems
