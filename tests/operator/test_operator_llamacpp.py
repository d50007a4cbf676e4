"""A Kubernetes pool of llama.cpp workers gets its slots and the eviction price: the operator
feeds the one scrape loop, whose llama.cpp adapter reads ``/props`` beside ``/metrics``.

The pods point at fake llama-servers on 127.0.0.1-2 (the real server's /metrics text, and
/props as llama-server answers it). Before the data layer, the operator's own loop never read
/props, so such a pool's directory stayed paged and no placement was priced for what it
overwrites."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from cachepilot.core import InferenceRequest
from cachepilot.tooling.stack import free_port

from helpers.kube import PODS, POOLS, Cluster, Operator, pod, pool
from helpers.paths import DATA
from helpers.polling import eventually

pytestmark = pytest.mark.timeout(60)
HOSTS = ("127.0.0.1", "127.0.0.2")
METRICS = (DATA / "llamacpp_metrics.txt").read_text()
N_CTX = 4096  # tokens per slot


class FakeLlamaServer:
    """llama-server's /metrics and /props, one slot (so a new prompt overwrites the last)."""

    def __init__(self) -> None:
        self.metrics_calls = self.props_calls = 0

    def app(self) -> web.Application:
        async def metrics(_: web.Request) -> web.Response:
            self.metrics_calls += 1
            return web.Response(text=METRICS)

        async def props(_: web.Request) -> web.Response:
            self.props_calls += 1
            return web.json_response({"total_slots": 1, "default_generation_settings":
                                      {"n_ctx": N_CTX, "temperature": 0.8}})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/props", props)
        return app


@pytest.fixture
async def llama_servers() -> AsyncIterator[tuple[int, list[FakeLlamaServer]]]:
    port, fakes, runners = free_port(), [], []
    for host in HOSTS:
        fake = FakeLlamaServer()
        runner = web.AppRunner(fake.app())
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        fakes.append(fake)
        runners.append(runner)
    try:
        yield port, fakes
    finally:
        for runner in runners:
            await runner.cleanup()


async def test_a_kubernetes_pool_of_llamacpp_workers_gets_slots_and_the_eviction_price(
        cluster: Cluster, llama_servers: tuple[int, list[FakeLlamaServer]]) -> None:
    port, fakes = llama_servers
    for i, host in enumerate(HOSTS):
        await cluster.create(PODS, pod(f"llama{i}", host, port=port))
    async with Operator(cluster, None, "gw-0") as op:  # None: real HTTP scrapes
        await cluster.create(POOLS, pool("p", scrape={"intervalSeconds": 0.2,
                                                      "engine": "llamacpp"}))
        addrs = [f"{h}:{port}" for h in HOSTS]
        await eventually(lambda: all(
            (m := op.router.pools["p"].workers[a].metrics) and m.slots for a in addrs),
            what="slots from /props on every worker")
        p = op.router.pools["p"]
        block = p.spec.block.block_size
        for a in addrs:
            m = p.workers[a].metrics
            assert (m.slots, m.slot_tokens) == (1, N_CTX)
            assert m.prefix_hits == 530  # the llama.cpp names were read, not vLLM's
            # The directory models the worker as one slot of the context, not a paged cache.
            assert p.directory.stats()[a]["capacity"] == N_CTX // block
        # /props is read once per worker, not at every scrape (again only after a failed
        # scrape, which a loaded machine may cause: the timeout is the interval, 0.2 s).
        await eventually(lambda: all(f.metrics_calls >= 4 for f in fakes)
                         and all(p.workers[a].ready for a in addrs))
        assert all(1 <= f.props_calls < f.metrics_calls for f in fakes)
        # (From here on no await: no scrape changes the pool under the decisions.)

        # A document asked about four times lives in its home's only slot...
        doc = "a shared handbook chapter about routing " * 60
        hot = []
        for i in range(4):
            d = op.router.route(InferenceRequest(model="m1", prompt=doc + f"question {i}?"),
                                time.time())
            op.router.release(d)
            hot.append(d.chosen)
        home = hot[0]
        assert hot == [home] * 4
        other = next(a for a in addrs if a != home)
        # ...so a one-off placed there would overwrite it: priced, and sent elsewhere.
        d = op.router.route(InferenceRequest(model="m1", prompt="one-off document " * 200),
                            time.time())
        op.router.release(d)
        by = {c.worker: c for c in d.candidates}
        assert by[home].evict_blocks > 0 and by[home].eviction_ms > 0
        assert by[other].eviction_ms == 0
        assert d.chosen == other
