"""InferenceObjectives (the Gateway API Inference Extension's ``inference.networking.x-k8s.io/
v1alpha2``) → flow control's priority bands.

A request names an objective in ``x-gateway-inference-objective``; flow control serves it in
the band of that objective's ``spec.priority`` (higher first; negative = sheddable). This
module keeps the name → priority table the gateway's flow control reads
(:attr:`cachepilot.core.flow.control.FlowControl.objectives`) in step with the watched
objects, as llm-d's director does (an objective without a priority, or an unknown name, is
priority 0: ``pkg/epp/requestcontrol/director.go``). The table is shared by reference and
only ever mutated on the gateway's event loop.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from cachepilot.operator.state import log

GROUP = "inference.networking.x-k8s.io"
VERSION = "v1alpha2"
PLURAL = "inferenceobjectives"
KIND = "InferenceObjective"


def priority_of(body: Mapping[str, Any]) -> int:
    """``spec.priority``, 0 when absent or not an integer (llm-d's default)."""
    spec = body.get("spec") or {}
    value = spec.get("priority") if isinstance(spec, Mapping) else None
    if isinstance(value, bool) or not isinstance(value, int):
        return 0
    return value


class Objectives:
    """Watch events of InferenceObjectives in, the priority table out."""

    def __init__(self, table: MutableMapping[str, int]) -> None:
        self.table = table
        self._uids: dict[str, str] = {}

    async def on_event(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        name, uid = meta.get("name", ""), meta.get("uid", "")
        if not name:
            return
        if event_type == "DELETED":
            if not uid or self._uids.get(name, uid) == uid:
                self.table.pop(name, None)
                self._uids.pop(name, None)
            return
        priority = priority_of(body)
        if self.table.get(name) != priority:
            log.info("InferenceObjective %s: priority %d", name, priority)
        self.table[name] = priority
        self._uids[name] = uid
