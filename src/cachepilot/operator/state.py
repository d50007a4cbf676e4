"""What the operator remembers per CachePilotPool, shared by its parts.

Why plain mutable records: every part (reconciling, scrape settings, status, Events) runs on the
gateway's event loop, so they share these objects without locks, and each part touches
only its own fields.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass, field
from typing import Any

from cachepilot.core import Pool
from cachepilot.datalayer.kv_events import Endpoints
from cachepilot.operator.spec import InvalidSpec, PoolConfig

# One logger name for all the controller's parts: the gateway's log lines show the name,
# and they read "cachepilot.operator.controller" as they did before the split.
log = logging.getLogger("cachepilot.operator.controller")


@dataclass(slots=True)
class Member:
    """A selected pod's port with an address: a worker of the pool (ready or not). A pod is
    one member, or one per target port of an InferencePool with several."""

    pod: str
    address: str
    scrape_url: str
    ready: bool
    kv_events: Endpoints | None = None  # where it publishes KV-cache events, if it does


@dataclass(slots=True)
class PoolState:
    """One router pool as this replica sees it: spec, router pool, members, status. It comes
    from a CachePilotPool (``kind``), or from an InferencePool no CachePilotPool claims (then
    ``name`` is the router's, ``inferencepool/<name>``, and no status is written)."""

    name: str
    uid: str
    body_ref: dict[str, str]  # for Events' involvedObject
    kind: str = "CachePilotPool"
    body: Any = None  # the last CachePilotPool body: re-parsed when its InferencePool changes
    generation: int = 0
    config: PoolConfig | None = None  # last valid spec (kept while a newer one is invalid)
    error: InvalidSpec | None = None  # the newest spec's problem, if any
    pool: Pool | None = None  # the router's pool, once a valid spec was seen
    members: dict[str, Member] = field(default_factory=dict)  # pod name (or pod:port) → member
    kv_events: dict[str, Endpoints] = field(default_factory=dict)  # worker address → publisher
    scrape_urls: dict[str, str] = field(default_factory=dict)  # worker address → its metrics
    selected: set[str] = field(default_factory=set)  # pods the selector matches
    unresolved: set[str] = field(default_factory=set)  # selected, but no port/IP yet
    last_status: dict[str, Any] | None = None
    last_patch_at: float = float("-inf")
    transitions: dict[str, tuple[str, str]] = field(default_factory=dict)  # type → (st, time)
    ready_reason: str | None = None
    warned_generation: int | None = None


def rfc3339(t: float) -> str:
    """Kubernetes' timestamp format (seconds, UTC, ``Z``) for a wall-clock time."""
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
