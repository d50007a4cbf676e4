"""Pod bodies → the plain values the controller works with: what a pod is (ready, its IP,
labels and annotations) and which of its ports a pool's port reference names.

Pure, as :mod:`cachepilot.operator.spec`, which reads the pools these pods serve.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PortRef = int | str | None  # a port by number or by a container port's name; None: the only one


@dataclass(frozen=True, slots=True)
class PodView:
    """The parts of a Pod the operator needs, copied out of kopf's body."""

    name: str
    uid: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    ip: str | None
    ready: bool  # Ready condition True, not terminating, not finished
    terminating: bool
    ports: tuple[tuple[str | None, int], ...]  # (name, containerPort) over all containers


def pod_view(body: Mapping[str, Any]) -> PodView:
    meta = body.get("metadata") or {}
    status = body.get("status") or {}
    spec = body.get("spec") or {}
    terminating = bool(meta.get("deletionTimestamp"))
    conditions = status.get("conditions") or []
    cond_ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    finished = status.get("phase") in ("Succeeded", "Failed")
    ports = tuple(
        (p.get("name"), int(p["containerPort"]))
        for c in spec.get("containers") or []
        for p in c.get("ports") or []
        if isinstance(p.get("containerPort"), int)
    )
    ip = status.get("podIP") or None
    return PodView(
        name=meta.get("name", ""), uid=meta.get("uid", ""), labels=dict(meta.get("labels") or {}),
        annotations=dict(meta.get("annotations") or {}), ip=ip,
        ready=cond_ready and not terminating and not finished and ip is not None,
        terminating=terminating, ports=ports,
    )


def resolve_port(ref: PortRef, pod: PodView) -> int | None:
    """A port number for ``ref`` on ``pod``: numbers as is, names through the containers'
    declared ports, ``None`` through the pod's only declared port."""
    if isinstance(ref, int):
        return ref
    if ref is None:
        numbers = {n for _, n in pod.ports}
        return numbers.pop() if len(numbers) == 1 else None
    for name, number in pod.ports:
        if name == ref:
            return number
    return None


def host_port(ip: str, port: int) -> str:
    """``ip:port`` as Envoy's ORIGINAL_DST cluster reads it (IPv6 in brackets)."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
