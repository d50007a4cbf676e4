"""Leader election on a real Lease object (KMock): take-over only after the holder has been
silent for the lease duration on the candidate's own clock, and stepping down when renewals
fail past the renew deadline."""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import kmock as K
import kopf
import pytest

from cachepilot.operator.kube import Conflict, KubeClient, NotFound
from cachepilot.operator.lease import LeaderElector

from helpers.polling import eventually

pytestmark = pytest.mark.timeout(30)
NS = "serving"


@pytest.fixture
async def client(kmock: K.KubernetesEmulator) -> AsyncIterator[KubeClient]:
    kmock.resources.load_bundled()
    c = KubeClient(kopf.ConnectionInfo(server=str(kmock.url).rstrip("/")), backoffs=(0.02,))
    yield c
    await c.close()


def elector(client: KubeClient | MemoryLeases, identity: str,
            changes: list[bool] | None = None, **timings: float) -> LeaderElector:
    timings = {"lease_duration_s": 0.6, "renew_deadline_s": 0.4, "retry_period_s": 0.05,
               **timings}
    return LeaderElector(client, namespace=NS, name="lead", identity=identity,  # type: ignore[arg-type]
                         on_change=None if changes is None else changes.append, **timings)


def holder(kmock: K.KubernetesEmulator) -> str | None:
    return kmock.objects["coordination.k8s.io/v1/leases", NS, "lead"].raw["spec"].get(
        "holderIdentity")


async def test_takeover_waits_for_an_expired_lease(kmock: K.KubernetesEmulator,
                                                   client: KubeClient) -> None:
    a, b = elector(client, "a"), elector(client, "b")
    assert await a.try_acquire_or_renew() is True
    assert holder(kmock) == "a"
    # While a renews, b never takes over, however long it watches.
    for _ in range(15):
        assert await a.try_acquire_or_renew() is True
        assert await b.try_acquire_or_renew() is False
        await asyncio.sleep(0.06)
    # a stops renewing (crashed): b takes over once it has seen no change for 0.6 s.
    started = time.monotonic()
    await eventually(b.try_acquire_or_renew, retry_on=(), what="b taking the lease over")
    assert time.monotonic() - started >= 0.55
    lease = kmock.objects["coordination.k8s.io/v1/leases", NS, "lead"].raw["spec"]
    assert lease["holderIdentity"] == "b" and lease["leaseTransitions"] == 1
    # a comes back and finds b holding a fresh lease.
    assert await a.try_acquire_or_renew() is False


async def test_a_leader_steps_down_when_it_cannot_renew_and_releases_on_stop(
        kmock: K.KubernetesEmulator, client: KubeClient) -> None:
    failing = {"on": False}

    def outage(_: object) -> None:
        # KMock retires a reaction once it answers None: it fails until switched off.
        if failing["on"]:
            raise K.KubernetesError(status=503, reason="Unavailable", message="down")

    leases = K.resource("coordination.k8s.io/v1/leases")
    changes: list[bool] = []
    # Deadlines of seconds, not tenths: a starved test machine must not miss a renewal.
    a = elector(client, "a", changes, lease_duration_s=3.0, renew_deadline_s=2.0)
    stop = asyncio.Event()
    task = asyncio.create_task(a.run(stop))
    await eventually(lambda: changes == [True] and a.is_leader)
    failing["on"] = True
    kmock[leases, K.action.FETCH] << outage
    kmock[leases, K.action.UPDATE] << outage
    outage_at = time.monotonic()
    await eventually(lambda: changes == [True, False], timeout=10)
    # It kept leading through failed renewals (every 0.05 s) until the 2 s deadline; the
    # bound leaves room for a starved loop having renewed late before the outage.
    assert time.monotonic() - outage_at >= 1.0
    assert not a.is_leader
    failing["on"] = False
    # Its own record is unchanged for the lease duration: it may take it back.
    await eventually(lambda: changes == [True, False, True], timeout=10)
    stop.set()
    async with asyncio.timeout(5):
        await task
    assert changes[-1] is False and holder(kmock) is None


class MemoryLeases:
    """The three Lease calls the elector makes, in memory, each taking one loop tick, with
    the API server's resourceVersion precondition (409 on a stale one)."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.before_patch: Callable[[], None] | None = None

    def _store(self, spec: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        self.lease = {"metadata": {"resourceVersion": str(self.version)}, "spec": spec}
        return copy.deepcopy(self.lease)

    async def get(self, path: str) -> Any:
        await asyncio.sleep(0)
        if self.lease is None:
            raise NotFound(404, path)
        return copy.deepcopy(self.lease)

    async def create(self, path: str, body: Any) -> Any:
        await asyncio.sleep(0)
        if self.lease is not None:
            raise Conflict(409, path)
        return self._store(body["spec"])

    async def merge_patch(self, path: str, body: Any) -> Any:
        await asyncio.sleep(0)
        if self.before_patch is not None:
            self.before_patch()
        assert self.lease is not None
        if body["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
            raise Conflict(409, "the object has been modified")
        return self._store({**self.lease["spec"], **body["spec"]})


async def test_a_cancelled_elector_always_ends_and_releases() -> None:
    """Cancel the campaign at every point of its loop, including the tick in which a renewal
    completes (where Python 3.11's asyncio.wait_for used to swallow the cancellation and
    leave the task running forever)."""
    for ticks in range(60):
        api = MemoryLeases()
        a = elector(api, "a", retry_period_s=0)
        task = asyncio.create_task(a.run(asyncio.Event()))
        for _ in range(ticks):
            await asyncio.sleep(0)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=2)
        assert done, f"cancelled after {ticks} ticks, the elector kept running"
        assert task.cancelled()
        if api.lease is not None:
            assert api.lease["spec"]["holderIdentity"] is None, ticks


async def test_release_reads_again_when_a_late_renewal_lands_first() -> None:
    api = MemoryLeases()
    a = elector(api, "a")
    assert await a.try_acquire_or_renew() is True

    def renewal_lands() -> None:  # once: a renewal sent before shutdown reaches the server
        api.before_patch = None
        assert api.lease is not None
        api._store({**api.lease["spec"], "renewTime": "later"})

    api.before_patch = renewal_lands
    await a.release()
    assert api.lease is not None and api.lease["spec"]["holderIdentity"] is None
