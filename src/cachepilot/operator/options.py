"""The operator's tunables, in one frozen value.

Why one dataclass: the runner, the controller's parts and the tests all need the same
periods and backoffs, and tests shrink them with ``dataclasses.replace`` instead of
patching module constants.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class OperatorOptions:
    """Knobs with production defaults; tests shrink the periods."""

    status_min_interval_s: float = 5.0  # at most one status patch per pool per this
    status_tick_s: float = 1.0
    lease_name: str = "cachepilot-gateway"
    lease_duration_s: float = 15.0
    lease_renew_deadline_s: float = 10.0
    lease_retry_period_s: float = 2.0
    elect_leader: bool = True  # False: this replica always writes (single-replica installs)
    api_backoffs: tuple[float, ...] = (0.5, 1, 2, 4, 8)  # our writes (status, events, lease)
    watch_error_backoffs: tuple[float, ...] = (1, 1, 2, 3, 5, 8, 13, 21)  # kopf's watches
    max_events_queued: int = 1000
    # Relist pods and pools this often (and after every watcher restart) to catch deletions
    # a watch gap hid (410 Gone relists and restarts replay what exists, not what vanished).
    resync_period_s: float = 60.0
    # The watcher (kopf) is restarted with these delays if it dies (e.g. API down too long).
    restart_backoffs: tuple[float, ...] = (1, 2, 5, 10, 30)
    # Watch InferencePools (inference.networking.k8s.io/v1; the CRD must be installed): each
    # whose endpointPickerRef names this Service becomes a pool, and CachePilotPools may
    # reference any of them (spec.inferencePoolRef). None: InferencePools are not watched.
    epp_service: str | None = None
    # Watch InferenceObjectives of this API group (the CRD must be installed): a request's
    # x-gateway-inference-objective header selects the priority band of the objective it
    # names (cachepilot.operator.objectives). None: not watched.
    objectives_group: str | None = None
