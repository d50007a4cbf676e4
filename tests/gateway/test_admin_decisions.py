"""The admin API's decision by id: a decision still queued for the decision log (an idle
writer ticks every 0.5 s) is written before the API answers, not a 404."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from cachepilot.core import BlockConfig, Weights, WorkerMetrics, parse_openai_body
from cachepilot.core.router import static_router
from cachepilot.gateway.server import GatewayConfig
from cachepilot.tooling.stack import free_port

from helpers.gateway_thread import GatewayThread

WORKER = "127.0.0.1:1"  # never contacted: the test routes in process, scrapes are off


class OnlyWhenSet(threading.Event):
    def wait(self, timeout: float | None = None) -> bool:
        return super().wait()  # the timeout (the writer's tick) ignored


def test_a_decision_still_queued_is_written_before_the_answer(tmp_path: Path) -> None:
    router = static_router([WORKER], policy="priced", weights=Weights(), models=("m",),
                           block=BlockConfig(), capacity_blocks=4096, engine="sim")
    admin = free_port()
    cfg = GatewayConfig(grpc_address=f"127.0.0.1:{free_port()}", admin_port=admin,
                        decision_log=str(tmp_path / "log"), scrape_interval_s=3600.0)
    with GatewayThread(router, cfg) as gw:
        recorder = gw.gateway.recorder
        assert recorder is not None
        # The writer drains only when woken (a flush, the close), never on its tick: once
        # its current tick (0.5 s at most) is over, whatever is queued stays queued.
        recorder._wake = OnlyWhenSet()
        time.sleep(1.0)

        def route() -> str:
            pool = router.pools["default"]
            pool.update_metrics(WORKER, WorkerMetrics(waiting=0, running=0, kv_usage=0.0,
                                                      num_blocks=4096, scraped_at=time.time()))
            req = parse_openai_body("/v1/completions", b'{"model": "m", "prompt": "hello"}')
            return router.route(req, time.time()).id

        decision_id = gw.call(route)
        assert recorder.get(decision_id) is None  # still queued
        r = httpx.get(f"http://127.0.0.1:{admin}/decisions/{decision_id}", timeout=10)
        assert r.status_code == 200, r.text
        assert r.json()["record"]["chosen"] == WORKER
        missing = httpx.get(f"http://127.0.0.1:{admin}/decisions/nope", timeout=10)
        assert missing.status_code == 404 and missing.json() == {"error": "no such decision"}
