"""The routing core: request → fingerprint → directory match → priced terms → pick → record.

Pure and synchronous: every function takes ``now`` from its caller, so the live gateway
(wall clock), the simulator (virtual clock) and replay (recorded clock) share one code path.
"""

from cachepilot.routing.cost import CostModel, Weights
from cachepilot.routing.decision import Candidate, Decision, RoutingError
from cachepilot.routing.directory import PrefixDirectory
from cachepilot.routing.fingerprint import BlockConfig, Fingerprint, chain_hashes, fingerprint
from cachepilot.routing.pool import Pool, PoolSpec
from cachepilot.routing.request import InferenceRequest, RequestError, parse_openai_body
from cachepilot.routing.router import Router
from cachepilot.routing.workers import WorkerMetrics, WorkerState

__all__ = [
    "BlockConfig",
    "Candidate",
    "CostModel",
    "Decision",
    "Fingerprint",
    "InferenceRequest",
    "Pool",
    "PoolSpec",
    "PrefixDirectory",
    "RequestError",
    "Router",
    "RoutingError",
    "Weights",
    "WorkerMetrics",
    "WorkerState",
    "chain_hashes",
    "fingerprint",
    "parse_openai_body",
]
