"""The chart's pod, on one machine: the gateway (ext_proc) with the operator inside it, Envoy
with the chart's configuration (ports moved), KMock as the API server and three real
simulated workers on 127.0.0.1-3 as the "pods". The kind e2e asserts the same things in a
real cluster; this runs everywhere Envoy installs."""

from __future__ import annotations

import asyncio
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import httpx
import kopf
import pytest

from cachepilot.core import Router
from cachepilot.deploy.envoy import render
from cachepilot.deploy.generate import chart_envoy_options
from cachepilot.gateway.server import Gateway, GatewayConfig
from cachepilot.operator import run_operator
from cachepilot.tooling.stack import envoy_binary, free_port

from helpers.kube import FAST, HOSTS, NS, PODS, POOLS, Cluster, pod, pool
from helpers.polling import eventually
from helpers.tools import have_envoy

pytestmark = [pytest.mark.envoy, pytest.mark.timeout(90),
              pytest.mark.skipif(not have_envoy(), reason="no envoy binary")]
MODEL = "sim-llama-8b"
PREFIX = "You are a careful assistant. Answer from this manual. " * 60


async def start_envoy(ext_proc_port: int, tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    port, admin = free_port(), free_port()
    config = tmp / "envoy.yaml"
    config.write_text(render(chart_envoy_options(listen_address="127.0.0.1", listen_port=port,
                                                 admin_port=admin,
                                                 ext_proc_port=ext_proc_port)))
    proc = subprocess.Popen([envoy_binary(), "-c", str(config), "--disable-hot-restart",
                             "--log-level", "warn"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    async with httpx.AsyncClient() as c:
        async def ready() -> bool:
            try:
                return (await c.get(f"http://127.0.0.1:{admin}/ready")).status_code == 200
            except httpx.TransportError:
                return False

        try:
            await eventually(ready, timeout=20, interval=0.1, what="envoy ready")
        except AssertionError:
            proc.kill()
            raise
    return proc, f"http://127.0.0.1:{port}"


async def complete(c: httpx.AsyncClient, prompt: str) -> tuple[int, str, str]:
    r = await c.post("/v1/completions", json={"model": MODEL, "prompt": prompt,
                                              "max_tokens": 4})
    return (r.status_code, r.headers.get("x-cachepilot-worker", ""),
            r.headers.get("x-cachepilot-decision-id", ""))


async def test_the_chart_pod_on_one_machine(cluster: Cluster, workers: int) -> None:
    port = workers
    for i, host in enumerate(HOSTS):
        await cluster.create(PODS, pod(f"w{i}", host, port=port))
    router = Router()
    gateway = Gateway(router, GatewayConfig(grpc_address="127.0.0.1:0", admin_port=0))
    await gateway.start()
    stop, ready = asyncio.Event(), asyncio.Event()
    gateway.add_task(run_operator(router, namespace=NS, stop_flag=stop, ready_flag=ready,
                                  identity="gw-0", options=FAST,
                                  login=lambda: kopf.ConnectionInfo(server=cluster.url),
                                  scraper=gateway.scraper))
    envoy = None
    try:
        async with asyncio.timeout(10):
            await ready.wait()
        await cluster.create(POOLS, pool("sim", models=[MODEL], scrape={
            "intervalSeconds": 0.1, "engine": "sim"}))
        await eventually(lambda: cluster.status("sim").get("readyWorkers") == 3
                         and cluster.condition("sim")["status"] == "True")
        envoy, url = await start_envoy(gateway.grpc_port, Path(tempfile.mkdtemp()))
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            # Decision ids come back, one per request.
            results = [await complete(c, f"hello {i}") for i in range(4)]
            assert {s for s, _, _ in results} == {200}
            assert len({d for _, _, d in results}) == 4
            # Requests sharing a prefix land on one worker.
            placed = [(await complete(c, f"{PREFIX} question {i}"))[1] for i in range(6)]
            assert len(set(placed[1:])) == 1, placed
            victim = placed[-1]
            victim_pod = f"w{HOSTS.index(victim.split(':')[0])}"
            # Not ready → no new requests, even for its own prefix.
            await cluster.patch(f"{PODS}/{victim_pod}", {"status": {"conditions": [
                {"type": "Ready", "status": "False"}]}})
            await eventually(lambda: not router.pools["sim"].workers[victim].ready)
            after = Counter([(await complete(c, f"{PREFIX} more {i}"))[1] for i in range(8)])
            assert victim not in after and sum(after.values()) == 8
            # Deleted → gone from the router, and still nothing sent to it.
            await cluster.delete(f"{PODS}/{victim_pod}")
            await eventually(lambda: victim not in router.pools["sim"].workers)
            after = Counter([(await complete(c, f"x {i}"))[1] for i in range(8)])
            assert victim not in after and sum(after.values()) == 8
        # The pool's status says so, written by this replica.
        await eventually(lambda: cluster.status("sim")["workers"] == 2)
        assert cluster.status("sim")["writer"] == "gw-0"
    finally:
        stop.set()
        if envoy is not None:
            envoy.terminate()
            envoy.wait(10)
        await gateway.stop()
