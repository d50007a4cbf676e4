"""The gateway follows its workers' KV-cache events (--kv-events-port): the directory becomes
the engine's block set, and /workers and /pools say each worker's mode."""

from __future__ import annotations

import json

import aiohttp

from cachepilot.core.cost import Weights
from cachepilot.core.fingerprint import BlockConfig
from cachepilot.core.kv_events import BlockStored
from cachepilot.core.router import static_router
from cachepilot.datalayer.kv_events import port_endpoints
from cachepilot.gateway.server import Gateway, GatewayConfig
from cachepilot.tooling.kv_event_publisher import KVEventPublisher
from cachepilot.tooling.stack import free_port_pair

from helpers.polling import eventually


async def test_the_gateway_attaches_to_each_workers_events_and_reports_the_mode() -> None:
    port = free_port_pair()
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}")
    worker = "127.0.0.1:1"  # nothing listens (its scrapes fail): only its events matter here
    router = static_router([worker], policy="priced", weights=Weights(), models=(),
                           block=BlockConfig(16), capacity_blocks=1000, engine="vllm")
    gw = Gateway(router, GatewayConfig(grpc_address="127.0.0.1:0", admin_port=0,
                                       stall_after_s=0,
                                       kv_endpoints=port_endpoints(port, port + 1,
                                                                   "kv-events")))
    await gw.start()
    try:
        pub.publish([BlockStored((11, 12, 13))])
        pool = router.pools["default"]

        def arrived() -> bool:
            if pool.directory.match([11, 12, 13], [worker])[worker] == 3:
                return True
            pub.publish([])  # heartbeat-like traffic until the subscription is up
            return False

        await eventually(arrived, timeout=10, interval=0.1, retry_on=(),
                         what="the events reaching the directory")
        async with aiohttp.ClientSession() as s:
            base = f"http://127.0.0.1:{gw.admin_port}"
            async with s.get(f"{base}/workers") as r:
                (w,) = json.loads(await r.text())
            async with s.get(f"{base}/pools") as r:
                (p,) = json.loads(await r.text())
        assert w["directory_mode"] == "exact" and w["kv_events"]["malformed"] == 0
        assert p["modes"][worker]["mode"] == "exact"
    finally:
        await gw.stop()
        pub.close()
