"""A gateway without gRPC: a router with the gateway's lifecycle plugins, the director and
our Envoy-stream adapter, driven with plain ProcessingRequest messages."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from cachepilot.core import Router
from cachepilot.core.flow.config import FlowConfig
from cachepilot.core.flow.control import FlowControl
from cachepilot.core.lifecycle import Outcome, Plugin
from cachepilot.gateway.director import Director, GatewayOptions
from cachepilot.gateway.envoy_streams import EnvoyStreams, RoutingStream
from cachepilot.gateway.epp import EppStream
from cachepilot.gateway.gateway_metrics import GatewayMetrics
from cachepilot.gateway.plugins import MetricsPlugin, StallTracker
from cachepilot.records.plugins import lifecycle_plugins
from cachepilot.records.schema import outcome_fields

from helpers.routers import make_router


class ListSink:
    """Decisions and outcomes as the decision log would get them, in memory."""

    def __init__(self) -> None:
        self.decisions: list[tuple[Any, str | None]] = []
        self.outcomes: dict[str, dict[str, Any]] = {}

    def decision(self, d: Any, pool: Any = None, *, prompt: str | None = None) -> None:
        self.decisions.append((d, prompt))

    def outcome(self, decision_id: str, outcome: Outcome) -> None:
        self.outcomes[decision_id] = outcome_fields(outcome)


class Box:
    """``box.handle(stream, msg)`` answers like the gateway; ``box.stream(...)`` opens a
    routing stream with the settings Envoy's metadata would give it. With ``flow``, flow
    control holds what no worker should take (``handle`` then returns a Pending)."""

    def __init__(self, router: Router | None = None, *, options: GatewayOptions | None = None,
                 clock: Callable[[], float] = lambda: 100.0, plugins: Sequence[Plugin] = (),
                 learn: bool = False, capture_prompts: bool = False,
                 flow: FlowConfig | None = None) -> None:
        self.router = router or make_router()
        self.sink = ListSink()
        self.stalls = StallTracker()
        self.metrics = GatewayMetrics()
        life = lifecycle_plugins(learn=learn, sink=self.sink, capture_prompts=capture_prompts,
                                 extra=(MetricsPlugin(self.metrics), self.stalls, *plugins))
        for p in life.plugins:
            self.router.add_plugin(p)
        self.flow = None if flow is None else FlowControl(self.router, flow)
        if self.flow is not None:
            self.router.add_plugin(self.flow.plugin)
        self.director = Director(self.router, options=options, clock=clock, flow=self.flow)
        self.streams = EnvoyStreams(self.director)

    @property
    def options(self) -> GatewayOptions:
        return self.director.options

    @staticmethod
    def stream(**settings: Any) -> RoutingStream:
        path = settings.pop("path", None)
        s = RoutingStream(**settings)
        if path is not None:
            s.ex.path = path
        return s

    def handle(self, s: RoutingStream, msg: Any) -> list[Any]:
        return self.streams.handle(s, msg)

    def observe(self, ex: Any, msg: Any) -> Any:
        return self.streams.observe(ex, msg)

    def epp(self) -> EppStream:
        return EppStream(self.director)
