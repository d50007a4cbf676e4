"""CachePilot: a prefix-cache-aware gateway for LLM inference.

The routing core lives in :mod:`cachepilot.core` and does no I/O; the gateway
(:mod:`cachepilot.gateway`), the simulator (:mod:`cachepilot.sim`) and replay drive it.
"""

__version__ = "0.1.0"
