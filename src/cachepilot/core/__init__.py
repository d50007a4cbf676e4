"""The routing core: request → fingerprint → directory match → priced terms → pick → record.

Pure and synchronous: every function takes ``now`` from its caller, so the live gateway
(wall clock), the simulator (virtual clock) and replay (recorded clock) share one code path.
"""

from cachepilot.core.cost import CostModel, Weights
from cachepilot.core.decision import Candidate, Decision, RoutingError
from cachepilot.core.directory import PrefixDirectory
from cachepilot.core.fingerprint import BlockConfig, Fingerprint, chain_hashes, fingerprint
from cachepilot.core.pool import Pool, PoolSpec
from cachepilot.core.request import InferenceRequest, RequestError, parse_openai_body
from cachepilot.core.router import Router
from cachepilot.core.workers import WorkerMetrics, WorkerState

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
