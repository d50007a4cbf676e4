"""The operator feeding the one scrape loop (real HTTP: ``scrape_once``) against real
simulated workers: three ``cachepilot sim-worker`` apps on 127.0.0.1-3, pods pointing at
them in KMock. Metrics must flow from the workers' /metrics into the router, and load sent
to one worker must show up there and in the pool's status."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from cachepilot.operator.runner import default_login

from helpers.kube import HOSTS, PODS, POOLS, Cluster, Operator, pod, pool
from helpers.polling import eventually

pytestmark = pytest.mark.timeout(60)


async def test_real_scrapes_of_sim_workers_reach_router_and_status(
        cluster: Cluster, workers: int) -> None:
    port = workers
    for i, host in enumerate(HOSTS):
        await cluster.create(PODS, pod(f"w{i}", host, port=port))
    async with Operator(cluster, None, "gw-0") as op:  # None: real HTTP scrapes
        await cluster.create(POOLS, pool("p", models=["sim-llama-8b"], scrape={
            "intervalSeconds": 0.1, "engine": "sim"}))
        addrs = {f"{h}:{port}" for h in HOSTS}
        await eventually(lambda: set(op.workers()) == addrs and all(
            w.metrics is not None for w in op.router.pools["p"].workers.values()))
        w = op.router.pools["p"].workers[f"127.0.0.2:{port}"]
        assert w.metrics.waiting == 0 and w.metrics.kv_usage is not None
        assert w.metrics.num_blocks and w.metrics.block_size  # vllm:cache_config_info
        assert w.scrape_error is None

        # Load on one worker shows up in its scraped queue.
        async with aiohttp.ClientSession() as http:
            body = {"model": "sim-llama-8b", "prompt": "x " * 2000, "max_tokens": 200}
            url = f"http://127.0.0.2:{port}/v1/completions"
            tasks = [asyncio.create_task(http.post(url, json=body)) for _ in range(6)]
            try:
                # Queued first (waiting), then admitted to the batch (running).
                await eventually(lambda: w.metrics.running >= 1)
                await eventually(lambda: any(
                    line["address"] == f"127.0.0.2:{port}" and line.get("running", 0) >= 1
                    for line in cluster.status("p").get("workerStatus", [])))
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        # A worker that stops answering becomes an error, then stale, in the router.
        await cluster.patch(f"{PODS}/w0", {"status": {"podIP": "127.0.0.9"}})
        await eventually(lambda: op.router.pools["p"].workers.get(f"127.0.0.9:{port}")
                         and op.router.pools["p"].workers[f"127.0.0.9:{port}"].scrape_error)
        assert f"127.0.0.1:{port}" not in op.workers()


def test_default_login_reads_a_kubeconfig(tmp_path, monkeypatch) -> None:
    """Outside a pod (no service account) the operator logs in with the kubeconfig."""
    cfg = tmp_path / "kubeconfig"
    cfg.write_text("""apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:6443"}}]
users: [{name: u, user: {token: abc}}]
contexts: [{name: x, context: {cluster: c, user: u, namespace: serving}}]
current-context: x
""")
    monkeypatch.setenv("KUBECONFIG", str(cfg))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    info = default_login()
    assert info.server == "https://127.0.0.1:6443" and info.token == "abc"
    assert info.default_namespace == "serving"
