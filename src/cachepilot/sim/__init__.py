"""Discrete-event simulator: the gateway's Router in front of modelled engines, on a virtual
clock, plus peer policy models, workloads and traces. The studies that run it (``cachepilot
experiment``) are in :mod:`cachepilot.lab`."""

from cachepilot.sim.simulator import (
    RequestResult,
    RunResult,
    SimConfig,
    Simulator,
    ideal_ttfts,
    simulate,
)
from cachepilot.sim.workloads import Dist, SimRequest, Workload, WorkloadSpec, generate

__all__ = [
    "Dist",
    "RequestResult",
    "RunResult",
    "SimConfig",
    "SimRequest",
    "Simulator",
    "Workload",
    "WorkloadSpec",
    "generate",
    "ideal_ttfts",
    "simulate",
]
