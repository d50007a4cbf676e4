"""Leader election on a real Lease object (KMock): take-over only after the holder has been
silent for the lease duration on the candidate's own clock, and stepping down when renewals
fail past the renew deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import kmock as K
import kopf
import pytest

from cachepilot_operator.kube import KubeClient
from cachepilot_operator.lease import LeaderElector

pytestmark = pytest.mark.timeout(30)
NS = "serving"


@pytest.fixture
async def client(kmock: K.KubernetesEmulator) -> AsyncIterator[KubeClient]:
    kmock.resources.load_bundled()
    c = KubeClient(kopf.ConnectionInfo(server=str(kmock.url).rstrip("/")), backoffs=(0.02,))
    yield c
    await c.close()


def elector(client: KubeClient, identity: str, changes: list[bool] | None = None
            ) -> LeaderElector:
    return LeaderElector(client, namespace=NS, name="lead", identity=identity,
                         lease_duration_s=0.6, renew_deadline_s=0.4, retry_period_s=0.05,
                         on_change=None if changes is None else changes.append)


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
    while not await b.try_acquire_or_renew():
        await asyncio.sleep(0.02)
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
    a = elector(client, "a", changes)
    stop = asyncio.Event()
    task = asyncio.create_task(a.run(stop))
    await asyncio.sleep(0.2)
    assert changes == [True] and a.is_leader
    failing["on"] = True
    kmock[leases, K.action.FETCH] << outage
    kmock[leases, K.action.UPDATE] << outage
    await asyncio.sleep(0.2)
    assert a.is_leader  # within the renew deadline: still leading
    await asyncio.sleep(0.5)
    assert changes == [True, False] and not a.is_leader
    failing["on"] = False
    await asyncio.sleep(0.9)  # its own record is unchanged: it may take it back
    assert changes == [True, False, True]
    stop.set()
    await asyncio.wait_for(task, 5)
    assert changes[-1] is False and holder(kmock) is None
