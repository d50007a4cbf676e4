"""The operator tests' fixtures: the cluster (KMock with CachePilotPools, helpers.kube) and
three real simulated workers on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator

import kmock as K
import pytest
from aiohttp import web

from cachepilot.tooling.sim_worker import WorkerConfig, make_app
from cachepilot.tooling.stack import free_port

from helpers.kube import HOSTS, Cluster, open_cluster


@pytest.fixture
async def cluster(kmock: K.KubernetesEmulator) -> AsyncIterator[Cluster]:
    async with open_cluster(kmock) as c:
        yield c


@pytest.fixture
async def workers() -> AsyncIterator[int]:
    """``cachepilot sim-worker`` apps on each of :data:`HOSTS`, all on the port yielded."""
    port = free_port()
    runners = []
    for i, host in enumerate(HOSTS):
        runner = web.AppRunner(make_app(WorkerConfig(name=f"w{i}", speed=1.0)))
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        runners.append(runner)
    try:
        yield port
    finally:
        for runner in runners:
            await runner.cleanup()
