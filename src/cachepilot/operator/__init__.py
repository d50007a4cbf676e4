"""CachePilot's Kubernetes operator: CachePilotPools and their pods → the gateway's router.

It runs inside each gateway replica (:func:`run_operator`), so every replica routes on its
own live view; a Lease decides which one writes status and Events. See docs/kubernetes.md.
"""

from cachepilot.operator.controller import Controller, OperatorOptions
from cachepilot.operator.kv_sources import KVEventSources
from cachepilot.operator.runner import default_login, run_operator

__all__ = ["Controller", "KVEventSources", "OperatorOptions", "default_login", "run_operator"]
