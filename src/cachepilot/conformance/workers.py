"""Fake model servers for the conformance suite: OpenAI-shaped answers that say what the
worker received (who it is, the destination header, x-request-id, the body's hash and size,
the model), vLLM-named metrics an EPP can scrape, and switches to look saturated or down."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import orjson
from aiohttp import web

WORKER_HEADER = "x-fake-worker"  # the worker's own ip:port, on every answer
BODY_SHA_HEADER = "x-fake-body-sha256"  # of the whole answer body, computed before sending
# Set by the suite's Envoy on the upstream request: the EPP's envoy.lb metadata, as a string.
METADATA_ECHO_HEADER = "x-conformance-metadata-destination"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class FakeWorker:
    """One fake model server on ``host:port`` (the EPP under test must be told the address,
    ``[addr]:port`` for an IPv6 host)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host.strip("[]"), port
        self.address = f"[{self.host}]:{port}" if ":" in self.host else f"{self.host}:{port}"
        self.hits = 0  # requests received, but for /health and /metrics
        self.saturated = False  # metrics say: a huge queue and a full KV cache
        self.down = False  # metrics and inference fail (500/503)
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self._infer)
        app.router.add_post("/v1/chat/completions", self._infer)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def _seen(self, request: web.Request, raw: bytes, model: Any) -> dict[str, Any]:
        return {"worker": self.address,
                "destination": request.headers.get("x-gateway-destination-endpoint", ""),
                "metadata_destination": request.headers.get(METADATA_ECHO_HEADER, ""),
                "x-request-id": request.headers.get("x-request-id", ""),
                "content-length": request.headers.get("content-length"),
                "body_sha256": sha256(raw), "body_bytes": len(raw),
                # not "model": an EPP rewriting the model back must leave this echo alone
                "received_model": model}

    async def _infer(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.hits += 1
        if self.down:
            return web.json_response({"error": {"message": "down"}}, status=503,
                                     headers={WORKER_HEADER: self.address})
        try:
            doc = orjson.loads(raw)
        except orjson.JSONDecodeError:
            doc = {}
        doc = doc if isinstance(doc, dict) else {}
        ctl = doc.get("conformance") if isinstance(doc.get("conformance"), dict) else {}
        model = doc.get("model")
        seen = self._seen(request, raw, model)
        padding = "x" * int(ctl.get("response_bytes", 0))
        if doc.get("stream"):
            return await self._stream(request, model, seen, int(ctl.get("chunks", 5)),
                                      float(ctl.get("delay_ms", 0)) / 1000.0, padding)
        body = orjson.dumps({"id": "cmpl-fake", "object": "text_completion", "model": model,
                             "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                       "total_tokens": 2},
                             "conformance": seen, "padding": padding})
        return web.Response(body=body, content_type="application/json",
                            headers={WORKER_HEADER: self.address, BODY_SHA_HEADER: sha256(body)})

    async def _stream(self, request: web.Request, model: Any, seen: dict[str, Any],
                      chunks: int, delay_s: float, padding: str) -> web.StreamResponse:
        pieces = [b"data: " + orjson.dumps({"model": model, "seq": i, "choices": [
            {"index": 0, "text": f"tok{i} "}]}) + b"\n\n" for i in range(chunks)]
        pieces.append(b"data: " + orjson.dumps({"model": model, "conformance": seen,
                                                "padding": padding}) + b"\n\n")
        pieces.append(b"data: [DONE]\n\n")
        resp = web.StreamResponse(headers={
            "content-type": "text/event-stream", WORKER_HEADER: self.address,
            BODY_SHA_HEADER: sha256(b"".join(pieces))})
        await resp.prepare(request)
        for piece in pieces:
            await resp.write(piece)
            if delay_s:
                await asyncio.sleep(delay_s)
        await resp.write_eof()
        return resp

    async def _models(self, request: web.Request) -> web.Response:
        self.hits += 1
        return web.json_response({"object": "list", "data": [{"id": "conformance"}],
                                  "conformance": self._seen(request, b"", None)},
                                 headers={WORKER_HEADER: self.address})

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(status=503 if self.down else 200, text="down" if self.down else "ok")

    async def _metrics(self, _: web.Request) -> web.Response:
        if self.down:
            return web.Response(status=500, text="down")
        waiting, kv = (10_000, 1.0) if self.saturated else (0, 0.0)
        text = (f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n'
                f'vllm:num_requests_running{{model_name="m"}} 0\n'
                f'vllm:kv_cache_usage_perc{{model_name="m"}} {kv}\n'
                'vllm:cache_config_info{block_size="16",num_gpu_blocks="10000"} 1\n')
        return web.Response(text=text, content_type="text/plain")
