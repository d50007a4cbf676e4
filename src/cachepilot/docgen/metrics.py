"""The metrics reference: every metric the gateway exports, read from its registries (the
gateway's GatewayMetrics and the decision recorder's, each built on a fresh registry)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from cachepilot.docgen.markdown import code, generated_note, prose, table
from cachepilot.gateway.gateway_metrics import GatewayMetrics
from cachepilot.records.recorder import RecorderMetrics

PATH = "reference/metrics.md"


@dataclass(frozen=True)
class Metric:
    name: str  # as exposed (counters with _total)
    type: str
    help: str
    labels: tuple[str, ...]
    source: str


def _of(registry: CollectorRegistry, source: str) -> list[Metric]:
    out = []
    for collector in list(registry._collector_to_names):  # the registry's own index
        if isinstance(collector, MetricWrapperBase):
            fams = [(collector._name, collector._type, collector._documentation,
                     tuple(collector._labelnames))]
        else:
            fams = [(f.name, f.type, f.documentation, tuple(getattr(f, "_labelnames", ())))
                    for f in collector.describe()]
        for name, kind, doc, labels in fams:
            exposed = f"{name}_total" if kind == "counter" else name
            out.append(Metric(exposed, kind, doc, labels, source))
    return out


def metrics() -> list[Metric]:
    gateway = GatewayMetrics(CollectorRegistry())
    recorder = CollectorRegistry()
    RecorderMetrics(recorder)
    return [*_of(gateway.registry, "gateway"), *_of(recorder, "decision log")]


def page(_root: Path) -> str:
    ms = metrics()
    rows = [[code(m.name), m.type, ", ".join(m.labels), prose(m.help)] for m in ms]
    return "\n".join([
        "# Metrics\n",
        generated_note("src/cachepilot/gateway/gateway_metrics.py",
                       "src/cachepilot/records/recorder.py"),
        "The gateway serves these on its admin port, `GET /metrics` (no token needed; "
        "`:9090` in the chart). Counters end in `_total`; histograms also expose "
        "`_bucket{le}`, `_sum` and `_count`. `pool` is the pool's name, `worker` its "
        "`host:port`. The decision-log metrics appear when the gateway records decisions "
        "(`--decision-log`). [Observability](../observability.md) explains them with the "
        "dashboard's queries.\n",
        f"{len(ms)} metrics:\n",
        table(["name", "type", "labels", "help"], rows),
    ])
