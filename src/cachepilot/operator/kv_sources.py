"""Where each worker publishes vLLM KV-cache events, as the gateway's KVEventHub asks it.

The gateway follows the router's pools (``cachepilot.datalayer.kv_events.follow_pools``) and
asks one function, ``(pool, worker address) → Endpoints | None``, where each worker
publishes. In Kubernetes the answer is in the pool's ``spec.kvEvents`` and the worker's pod
(a port, or an annotation naming it), which only the operator knows: :class:`KVEventSources`
is that function, reading the operator's live view. Why a lookup rather than the operator
attaching subscriptions itself: the gateway already re-syncs its subscriptions with pool
membership every second (attach new workers, re-attach moved ones, detach gone ones), so a pod
that comes or goes is followed or dropped the same way in both deployments, with no second
copy of that logic.
"""

from __future__ import annotations

from collections.abc import Mapping

from cachepilot.datalayer.kv_events import Endpoints, EndpointsFor
from cachepilot.operator.state import PoolState


class KVEventSources:
    """An ``EndpointsFor`` over the operator's pools (bound by :func:`run_operator`).

    A pool without ``spec.kvEvents`` asks ``fallback`` (the gateway's ``--kv-events-port``
    convention, if given); a pool with it answers for its own workers only (a pod without
    the annotation, or not yet resolved, publishes nothing we follow).
    """

    def __init__(self, fallback: EndpointsFor | None = None) -> None:
        self.fallback = fallback
        self._pools: Mapping[str, PoolState] = {}

    def bind(self, pools: Mapping[str, PoolState]) -> None:
        self._pools = pools

    def __call__(self, pool: str, address: str) -> Endpoints | None:
        ps = self._pools.get(pool)
        if ps is None or ps.config is None or ps.config.kv_events is None:
            return self.fallback(pool, address) if self.fallback is not None else None
        return ps.kv_events.get(address)
