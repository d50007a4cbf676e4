"""The simulated worker behind ``cachepilot sim-worker``: an OpenAI-compatible server backed
by the engine model in real time, exposing vLLM's metric names, so the gateway cannot tell it
from a (very fast) vLLM.

With ``kv_events`` (``--kv-events-port P``) it also publishes its prefix cache's changes as
vLLM does (``--kv-events-config``): after every engine step, BlockStored / BlockRemoved in
vLLM's wire format on ``tcp://HOST:P``, replay on ``P + 1``
(:mod:`cachepilot.tooling.kv_event_publisher`), so the gateway's directory can run in exact
mode on simulated workers. Its block hashes are the ones the gateway computes for the same
``--block-size`` and ``--chars-per-token`` (the simulator's fingerprint)."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

import orjson
import zmq
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from cachepilot.core.fingerprint import BlockConfig, fingerprint
from cachepilot.core.request import CHAT_PATH, COMPLETIONS_PATH, RequestError, parse_openai_body
from cachepilot.gateway.protocol import DESTINATION_HEADER
from cachepilot.sim.engine import Engine, EngineConfig, EngineRequest
from cachepilot.tooling.kv_event_publisher import EngineTap, KVEventPublisher

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80)


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    model: str = "sim-llama-8b"
    engine: EngineConfig = field(default_factory=EngineConfig)
    chars_per_token: float = 4.0
    speed: float = 1.0  # model seconds per wall second
    default_max_tokens: int = 16
    name: str = "sim-worker"


class _Metrics:
    def __init__(self, cfg: WorkerConfig) -> None:
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting", labels, registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests running", labels, registry=r)
        self.kv = Gauge("vllm:kv_cache_usage_perc", "KV cache usage (0-1)", labels, registry=r)
        self.queries = Counter("vllm:prefix_cache_queries", "Prompt tokens queried", labels,
                               registry=r)
        self.hits = Counter("vllm:prefix_cache_hits", "Prompt tokens hit", labels, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "TTFT", labels,
                              buckets=_TTFT_BUCKETS, registry=r)
        info = Gauge("vllm:cache_config_info", "KV cache config",
                     ["block_size", "num_gpu_blocks"], registry=r)
        info.labels(str(cfg.engine.block_size), str(cfg.engine.num_blocks)).set(1)
        self.model = cfg.model


class SimWorker:
    """The engine on a real (scaled) clock plus per-request event queues."""

    def __init__(self, cfg: WorkerConfig, publisher: KVEventPublisher | None = None) -> None:
        self.cfg = cfg
        self.engine = Engine(cfg.engine)
        self.publisher = publisher
        self.tap = EngineTap(self.engine, publisher, cfg.engine.block_size) if publisher \
            else None
        self.block = BlockConfig(cfg.engine.block_size, cfg.chars_per_token)
        self.metrics = _Metrics(cfg)
        self._queues: dict[int, asyncio.Queue[str]] = {}
        self._ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._t0 = time.monotonic()
        self._task: asyncio.Task[None] | None = None
        self._synced_hits = self._synced_queries = 0

    def now(self) -> float:
        """Model time: wall time since start times the speed factor."""
        return (time.monotonic() - self._t0) * self.cfg.speed

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()

    async def _run(self) -> None:
        engine, speed = self.engine, self.cfg.speed
        while True:
            if not engine.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            res = engine.step(self.now())
            if res.duration <= 0:  # nothing schedulable (cannot happen with valid requests)
                self._wake.clear()
                await self._wake.wait()
                continue
            delay = self._t0 + res.end / speed - time.monotonic()
            await asyncio.sleep(max(0.0, delay))
            if self.tap is not None:  # as vLLM: the step's cache changes, once it is done
                self.tap.after_step()
            for req in res.first_tokens:
                self.metrics.ttft.labels(self.metrics.model).observe(req.first_token_at
                                                                     - req.arrival)
                self._put(req, "first")
            for req in res.decoded:
                self._put(req, "token")
            for req in res.finished:
                self._put(req, "done")

    def _put(self, req: EngineRequest, event: str) -> None:
        q = self._queues.get(req.id)
        if q is not None:
            q.put_nowait(event)

    def submit(self, body: bytes, path: str) -> tuple[EngineRequest, asyncio.Queue[str], bool]:
        req = parse_openai_body(path, body)
        if req.model != self.cfg.model:
            raise RequestError(404, f"model {req.model!r} not served; this worker serves "
                               f"{self.cfg.model!r}", code="model_not_found")
        fp = fingerprint(req.model, self.block, text=req.prompt, token_ids=req.token_ids)
        max_tokens = req.max_tokens if req.max_tokens is not None else self.cfg.default_max_tokens
        ereq = EngineRequest(id=next(self._ids), prompt_tokens=max(1, fp.tokens),
                             hashes=fp.hashes, max_tokens=max(1, max_tokens), arrival=self.now())
        try:
            self.engine.submit(ereq)
        except ValueError as exc:
            raise RequestError(400, str(exc)) from None
        q: asyncio.Queue[str] = asyncio.Queue()
        self._queues[ereq.id] = q
        self._wake.set()
        return ereq, q, req.stream

    def forget(self, ereq: EngineRequest) -> None:
        self._queues.pop(ereq.id, None)

    def render_metrics(self) -> bytes:
        m, s = self.metrics, self.engine.stats()
        m.waiting.labels(m.model).set(s.waiting)
        m.running.labels(m.model).set(s.running)
        m.kv.labels(m.model).set(s.kv_usage)
        m.queries.labels(m.model).inc(s.prefix_queries - self._synced_queries)
        m.hits.labels(m.model).inc(s.prefix_hits - self._synced_hits)
        self._synced_queries, self._synced_hits = s.prefix_queries, s.prefix_hits
        return generate_latest(m.registry)


def _usage(ereq: EngineRequest) -> dict[str, object]:
    return {"prompt_tokens": ereq.prompt_tokens, "completion_tokens": ereq.output,
            "total_tokens": ereq.prompt_tokens + ereq.output,
            "prompt_tokens_details": {"cached_tokens": ereq.cached_tokens}}


def _error(exc: RequestError) -> web.Response:
    return web.Response(status=exc.status, body=exc.to_json(), content_type="application/json")


def make_app(cfg: WorkerConfig, kv_events: tuple[str, str | None] | None = None
             ) -> web.Application:
    """The worker's app; with ``kv_events`` = (PUB endpoint, replay endpoint or None), it
    publishes its KV-cache events there (bound when the app starts, closed when it ends)."""
    publisher = KVEventPublisher(*kv_events) if kv_events else None
    worker = SimWorker(cfg, publisher)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app["worker"] = worker

    async def on_startup(_: web.Application) -> None:
        worker.start()

    async def on_cleanup(_: web.Application) -> None:
        await worker.stop()
        if publisher is not None:
            publisher.close()

    async def infer(request: web.Request) -> web.StreamResponse:
        chat = request.path.rstrip("/") == CHAT_PATH
        try:
            ereq, q, stream = worker.submit(await request.read(), request.path)
        except RequestError as exc:
            return _error(exc)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{cfg.name}-{ereq.id}"
        try:
            if stream:
                return await _stream(request, ereq, q, rid, chat, cfg)
            while await q.get() != "done":
                pass
            text = "tok " * ereq.output
            choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                       "finish_reason": "length"} if chat else
                      {"index": 0, "text": text, "finish_reason": "length"})
            body = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                    "created": int(time.time()), "model": cfg.model, "choices": [choice],
                    "usage": _usage(ereq)}
            return web.Response(body=orjson.dumps(body), content_type="application/json",
                                headers=_who(request, cfg))
        finally:
            worker.forget(ereq)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": cfg.model, "object": "model", "owned_by": "cachepilot-sim"}]})

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def kv_blocks(_: web.Request) -> web.Response:
        """The hashed blocks the engine holds (in use or cached free): what its KV events
        have announced, for tests and drills to compare with a subscriber's view."""
        e = worker.engine
        return web.json_response({"blocks": sorted(set(e._in_use) | set(e._free_cached))})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=worker.render_metrics(),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_post(COMPLETIONS_PATH, infer)
    app.router.add_post(CHAT_PATH, infer)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/debug/kv_blocks", kv_blocks)
    app.router.add_get("/metrics", metrics)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def _who(request: web.Request, cfg: WorkerConfig) -> dict[str, str]:
    """Response headers naming who answered and where the proxy said it routed the request
    (debugging, tests)."""
    seen = {"x-worker": cfg.name}
    if DESTINATION_HEADER in request.headers:
        seen["x-worker-routed-as"] = request.headers[DESTINATION_HEADER]
    return seen


async def _stream(request: web.Request, ereq: EngineRequest, q: asyncio.Queue[str], rid: str,
                  chat: bool, cfg: WorkerConfig) -> web.StreamResponse:
    """SSE like vLLM: headers at once, one chunk per token, usage last, then [DONE]."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache", **_who(request, cfg)})
    await resp.prepare(request)
    obj = "chat.completion.chunk" if chat else "text_completion"
    created = int(time.time())

    def chunk(piece: dict[str, object]) -> bytes:
        return b"data: " + orjson.dumps({"id": rid, "object": obj, "created": created,
                                         "model": cfg.model, **piece}) + b"\n\n"

    first = True
    while True:
        event = await q.get()
        if event in ("first", "token"):
            delta = ({"delta": {"role": "assistant", "content": "tok "} if first else
                      {"content": "tok "}} if chat else {"text": "tok "})
            first = False
            await resp.write(chunk({"choices": [{"index": 0, **delta, "finish_reason": None}]}))
        elif event == "done":
            break
    end = {"delta": {}} if chat else {"text": ""}
    await resp.write(chunk({"choices": [{"index": 0, **end, "finish_reason": "length"}],
                            "usage": _usage(ereq)}))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def serve(cfg: WorkerConfig, host: str, port: int, kv_events_port: int | None = None) -> None:
    """Serve one simulated worker until interrupted (OSError if a port is taken); with
    ``kv_events_port``, KV events on ``host:kv_events_port`` and replay on the next port."""
    events = (f"tcp://{host}:{kv_events_port}", f"tcp://{host}:{kv_events_port + 1}") \
        if kv_events_port else None
    try:
        app = make_app(cfg, events)
    except zmq.ZMQError as exc:
        raise OSError(exc.errno, f"KV events on {host}:{kv_events_port}: {exc}") from None
    web.run_app(app, host=host, port=port, print=None, access_log=None)

