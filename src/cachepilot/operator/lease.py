"""Leader election on a coordination.k8s.io/v1 Lease: only the leader writes pool status
and Events; every replica keeps watching and routing.

Why not kopf peering: peering pauses every replica but one, which would leave the others
routing on a frozen view. Here all replicas watch; the Lease decides only who writes.

The algorithm is client-go's: the holder renews ``renewTime`` every ``retry_period``; a
candidate takes over only after it has *observed* no change to the lease record for
``lease_duration`` of its own clock (so clock skew between nodes does not matter), and
patches with the record's ``resourceVersion`` as a precondition, so two candidates
cannot both win (409).
A leader that cannot renew within ``renew_deadline`` steps down before anyone else may
take over (renew_deadline < lease_duration).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Callable
from typing import Any

from cachepilot.operator.aio import wait_stopped
from cachepilot.operator.kube import ApiError, Conflict, KubeClient, NotFound

log = logging.getLogger(__name__)


def micro_time(t: float | None = None) -> str:
    dt = datetime.datetime.fromtimestamp(time.time() if t is None else t, datetime.UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _precondition(obj: dict[str, Any]) -> dict[str, Any]:
    rv = (obj.get("metadata") or {}).get("resourceVersion")
    return {"resourceVersion": rv} if rv else {}


class LeaderElector:
    def __init__(self, client: KubeClient, *, namespace: str, name: str, identity: str,
                 lease_duration_s: float = 15.0, renew_deadline_s: float = 10.0,
                 retry_period_s: float = 2.0,
                 on_change: Callable[[bool], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not retry_period_s < renew_deadline_s < lease_duration_s:
            raise ValueError("need retry_period < renew_deadline < lease_duration")
        self.client = client
        self.path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        self.namespace, self.name, self.identity = namespace, name, identity
        self.lease_duration_s = lease_duration_s
        self.renew_deadline_s = renew_deadline_s
        self.retry_period_s = retry_period_s
        self.on_change = on_change
        self.clock = clock
        self.is_leader = False
        self._observed: tuple[Any, Any] | None = None  # (holder, renewTime) last seen
        self._observed_at = 0.0
        self._last_renew = 0.0
        self._decided = False

    def _set(self, leader: bool) -> None:
        # The first round always reports, so a follower learns it is one (and can drop
        # what it held back while the election was undecided).
        first, self._decided = not self._decided, True
        if first and leader == self.is_leader and self.on_change:
            self.on_change(leader)
        if leader != self.is_leader:
            self.is_leader = leader
            log.info("%s %s leadership of lease %s/%s", self.identity,
                     "acquired" if leader else "lost", self.namespace, self.name)
            if self.on_change:
                self.on_change(leader)

    def _record(self, holder: str | None) -> dict[str, Any]:
        now = micro_time()
        return {"holderIdentity": holder,
                "leaseDurationSeconds": max(1, round(self.lease_duration_s)),
                "acquireTime": now, "renewTime": now}

    async def try_acquire_or_renew(self) -> bool:
        """One round; returns whether this replica leads afterwards."""
        now = self.clock()
        try:
            lease = await self.client.get(f"{self.path}/{self.name}")
        except NotFound:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": self._record(self.identity)}
            try:
                await self.client.create(self.path, body)
            except Conflict:
                return False
            self._last_renew = now
            return True
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity")
        observed = (holder, spec.get("renewTime"))
        if observed != self._observed:
            self._observed, self._observed_at = observed, now
        duration = float(spec.get("leaseDurationSeconds") or self.lease_duration_s)
        expired = now - self._observed_at >= duration
        if holder and holder != self.identity and not expired:
            return False
        record = dict(spec)
        if holder == self.identity:
            record["renewTime"] = micro_time()
        else:
            record.update(self._record(self.identity))
            record["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
        # A merge patch carrying metadata.resourceVersion is a precondition on the real API
        # server (409 if the lease changed since we read it), like an update, but PATCH.
        body = {"metadata": _precondition(lease), "spec": record}
        try:
            await self.client.merge_patch(f"{self.path}/{self.name}", body)
        except Conflict:
            return False
        self._observed, self._observed_at = (self.identity, record["renewTime"]), now
        self._last_renew = now
        return True

    async def run(self, stop: asyncio.Event) -> None:
        """Campaign until ``stop``; release the lease on the way out if held."""
        try:
            while not stop.is_set():
                ok: bool | None
                try:
                    async with asyncio.timeout(self.renew_deadline_s / 2):  # see aio
                        ok = await self.try_acquire_or_renew()
                except (ApiError, OSError, TimeoutError) as e:
                    log.warning("lease %s: %s", self.name, e)
                    ok = None  # unknown: keep leading until the renew deadline passes
                if ok:
                    self._set(True)
                elif (ok is False  # another holder, or a lost race (409)
                      or not self._decided  # unreachable at start: not leading
                      or (self.is_leader  # no renewal within the deadline
                          and self.clock() - self._last_renew >= self.renew_deadline_s)):
                    self._set(False)
                await wait_stopped(stop, self.retry_period_s)
        finally:
            if self.is_leader:
                self._set(False)
                await self.release()

    async def release(self, attempts: int = 3) -> None:
        """Give up the lease so a peer takes over at once instead of after the duration."""
        for _ in range(attempts):
            try:
                lease = await self.client.get(f"{self.path}/{self.name}")
                if (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                    return
                await self.client.merge_patch(f"{self.path}/{self.name}", {
                    "metadata": _precondition(lease),
                    "spec": {"holderIdentity": None, "leaseDurationSeconds": 1,
                             "renewTime": micro_time()}})
                return
            except Conflict:
                # A renewal cut off by our own shutdown can still land after the read
                # above: read again; the holder check stops us releasing someone else's.
                continue
            except (ApiError, OSError, TimeoutError) as e:
                log.info("could not release lease %s: %s", self.name, e)
                return
        log.info("could not release lease %s: it kept changing", self.name)
