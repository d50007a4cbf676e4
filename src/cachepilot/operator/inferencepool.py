"""InferencePool (``inference.networking.k8s.io/v1``, the Gateway API Inference Extension) as a
source of workers.

An InferencePool says which pods serve (``selector``) on which ports (``targetPorts``: each
``podIP:port`` is an endpoint of its own) and which endpoint picker (EPP) a Gateway API gateway
must ask where each request goes (``endpointPickerRef``: a Service and its port). When that
Service is CachePilot's, the operator builds a pool from the InferencePool exactly as it builds
one from a CachePilotPool (:func:`cachepilot.operator.spec.parse_pool` with this module's
:class:`~cachepilot.operator.spec.WorkerSource`), with the router's defaults for everything an
InferencePool cannot say (models, scrape, routing). A CachePilotPool may instead reference the
InferencePool (``spec.inferencePoolRef``) to add those settings; the InferencePool then makes
no pool of its own, so its pods are never two pools' workers.

Why no status is written to InferencePools: upstream's ``status.parents`` is one entry per
parent Gateway, written by the gateway implementation that accepted the pool (its
``controllerName``); the API defines no condition for the endpoint picker. Problems are
reported as Events on the InferencePool instead (and in a referencing CachePilotPool's status).

The CRD itself is vendored, not generated: ``charts/cachepilot/files/inferencepool-crd.yaml``
is upstream's file under a header naming its commit (the chart can install it; tests validate
every InferencePool we ship against it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cachepilot.operator.spec import InvalidSpec, WorkerSource, _port_ref, parse_selector

GROUP = "inference.networking.k8s.io"
VERSION = "v1"
KIND = "InferencePool"
PLURAL = "inferencepools"
API_VERSION = f"{GROUP}/{VERSION}"
# The router's name for a pool built from an InferencePool alone: a CachePilotPool of the same
# name may exist, and the prefix says where the pool came from in /pools and the metrics.
ROUTER_PREFIX = "inferencepool/"


def router_pool_name(name: str) -> str:
    """The router's pool name for InferencePool ``name`` when no CachePilotPool claims it."""
    return ROUTER_PREFIX + name


@dataclass(frozen=True, slots=True)
class PickerRef:
    """``spec.endpointPickerRef``, with upstream's defaults filled in."""

    group: str
    kind: str
    name: str
    port: int | None
    failure_mode: str


@dataclass(frozen=True, slots=True)
class InferencePoolView:
    """A parsed InferencePool: its workers and its endpoint picker (``None``: unset)."""

    name: str
    uid: str
    source: WorkerSource
    picker: PickerRef | None

    def picked_by(self, service: str) -> bool:
        """True if its endpoint picker is the Service ``service`` (core group, kind Service:
        upstream's defaults), i.e. a gateway asks us where its requests go."""
        p = self.picker
        return p is not None and p.group == "" and p.kind == "Service" and p.name == service


def parse(body: Mapping[str, Any]) -> InferencePoolView:
    """Validate an InferencePool body as the API server's schema would; raises
    :class:`~cachepilot.operator.spec.InvalidSpec` with a reason for the Event."""
    meta = body.get("metadata") or {}
    spec = body.get("spec")
    if not isinstance(spec, Mapping):
        raise InvalidSpec("InvalidSpec", "spec is missing")
    selector = parse_selector(spec.get("selector"))
    ports = spec.get("targetPorts")
    if not isinstance(ports, list) or not 1 <= len(ports) <= 8:
        raise InvalidSpec("InvalidPort", "spec.targetPorts must list 1 to 8 ports")
    numbers: list[int] = []
    for i, p in enumerate(ports):
        number = p.get("number") if isinstance(p, Mapping) else None
        if isinstance(number, bool) or not isinstance(number, int):
            raise InvalidSpec("InvalidPort", f"spec.targetPorts[{i}].number must be a number")
        checked = _port_ref(number, f"spec.targetPorts[{i}].number")
        assert isinstance(checked, int)
        numbers.append(checked)
    if len(set(numbers)) != len(numbers):
        raise InvalidSpec("InvalidPort", "spec.targetPorts: port number must be unique")
    return InferencePoolView(
        name=str(meta.get("name", "")), uid=str(meta.get("uid", "")),
        source=WorkerSource(selector, tuple(numbers), spec.get("selector") or {}),
        picker=_picker(spec.get("endpointPickerRef")))


def _picker(ref: Any) -> PickerRef | None:
    if ref is None:
        return None
    if not isinstance(ref, Mapping) or not isinstance(ref.get("name"), str) or not ref["name"]:
        raise InvalidSpec("InvalidExtensionRef", "spec.endpointPickerRef.name is missing")
    kind = ref.get("kind") or "Service"
    port = ref.get("port")
    number = port.get("number") if isinstance(port, Mapping) else None
    if kind == "Service" and not isinstance(number, int):
        raise InvalidSpec("InvalidExtensionRef", "spec.endpointPickerRef.port is required "
                          "when kind is 'Service'")
    return PickerRef(group=ref.get("group") or "", kind=kind, name=ref["name"],
                     port=number if isinstance(number, int) else None,
                     failure_mode=ref.get("failureMode") or "FailClose")
