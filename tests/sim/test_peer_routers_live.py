"""The peer routers' wheels (sglang-router 0.3.2, vllm-router 0.1.17, the ``peers`` extra)
behave as the simulator's models of them say (cachepilot.sim.peers, docs/research/
peer-models.md): each test starts two fake workers and the router, loads one worker with a
request it holds, then sends a prompt and sees where it goes.

* sglang-router ``cache_aware``: a novel prompt goes to the least-loaded worker, even when
  that worker holds the bigger tree (the old "smallest tree" rule would send it elsewhere).
* vllm-router ``cache_aware`` in front of workers without vLLM's ``/tokenize`` (llama-server,
  the sim worker): no affinity, the less loaded worker takes a prompt the other holds.
* vllm-router ``cache_aware`` in front of workers with it: the holder keeps its prefix even
  when busier; a novel prompt goes to the least loaded.

Skipped, with the reason, when the wheels are not installed (``pip install
'cachepilot[peers]'``); CI installs them and sets ``CACHEPILOT_REQUIRE_PEERS`` so a missing
router fails instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from cachepilot.tooling.stack import free_port

from helpers.polling import eventually

HOLD = "[[hold]]"
MODEL = "fake-model"


def _launcher(kind: str) -> Path:
    return Path(sys.executable).parent / f"{kind}-router"


def _need(kind: str) -> None:
    path = _launcher(kind)
    if path.exists():
        return
    why = f"{path.name} is not installed (pip install 'cachepilot[peers]')"
    if os.environ.get("CACHEPILOT_REQUIRE_PEERS"):
        pytest.fail(f"CACHEPILOT_REQUIRE_PEERS is set but {why}")
    print(f"skipping: {why}")
    pytest.skip(why)


def text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz    ") for _ in range(n))


@dataclass
class Workers:
    """Two fake OpenAI-style workers on loopback: a completion whose prompt contains
    :data:`HOLD` is held until :attr:`release` is set; every completion is logged as
    (worker, prompt). ``tokenize``: ``"vllm"`` answers ``/tokenize`` as vLLM does,
    ``"llama"`` as llama-server does (it wants ``content``)."""

    tokenize: str
    names: list[str] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    seen: list[tuple[str, str]] = field(default_factory=list)
    health_checked: set[str] = field(default_factory=set)  # workers asked GET /health
    release: asyncio.Event = field(default_factory=asyncio.Event)
    _runners: list[web.AppRunner] = field(default_factory=list)

    def app(self, name: str) -> web.Application:
        async def completions(request: web.Request) -> web.Response:
            body = await request.json()
            prompt = body.get("prompt", "")
            self.seen.append((name, prompt))
            if HOLD in prompt:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(60):
                        await self.release.wait()
            return web.json_response({
                "id": "x", "object": "text_completion", "model": MODEL,
                "choices": [{"index": 0, "text": name, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

        async def tokenize(request: web.Request) -> web.Response:
            body = await request.json()
            if self.tokenize == "vllm" and "prompt" in body:
                ids = [ord(c) for c in body["prompt"]]
                return web.json_response({"tokens": ids, "count": len(ids),
                                          "max_model_len": 1 << 20})
            if "content" in body:  # llama-server's shape: no count, no max_model_len
                return web.json_response({"tokens": [ord(c) for c in body["content"]]})
            return web.json_response({"error": "\"content\" must be provided"}, status=400)

        async def models(_: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [
                {"id": MODEL, "object": "model", "owned_by": "x", "max_model_len": 1 << 20}]})

        async def ok(request: web.Request) -> web.Response:
            if request.path == "/health":
                self.health_checked.add(name)
            return web.json_response({"model_path": MODEL, "served_model_name": MODEL})

        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", completions)
        app.router.add_post("/tokenize", tokenize)
        app.router.add_get("/v1/models", models)
        for path in ("/health", "/health_generate", "/get_model_info", "/get_server_info"):
            app.router.add_get(path, ok)
        return app

    async def start(self) -> None:
        for i in range(2):
            port = free_port()
            runner = web.AppRunner(self.app(f"w{i}"), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            self._runners.append(runner)
            self.names.append(f"w{i}")
            self.urls.append(f"http://127.0.0.1:{port}")

    async def stop(self) -> None:
        self.release.set()
        for r in self._runners:
            await r.cleanup()

    def other(self, name: str) -> str:
        return next(n for n in self.names if n != name)


@dataclass
class Router:
    """A peer router's process in front of :class:`Workers`, and a client to it."""

    base: str
    http: aiohttp.ClientSession
    workers: Workers
    held: list[asyncio.Task] = field(default_factory=list)

    async def send(self, prompt: str) -> str:
        """A quick completion: the worker that answered."""
        async with self.http.post(f"{self.base}/v1/completions",
                                  json={"model": MODEL, "prompt": prompt,
                                        "max_tokens": 1}) as r:
            assert r.status == 200, await r.text()
            return (await r.json(content_type=None))["choices"][0]["text"]

    async def hold(self, prompt: str) -> str:
        """A completion the worker holds (it stays in flight): the worker it reached."""
        before = len(self.workers.seen)
        self.held.append(asyncio.create_task(self.send(prompt + HOLD)))
        await eventually(lambda: len(self.workers.seen) > before, timeout=5, interval=0.01,
                         what="the held request reaching a worker")
        return self.workers.seen[-1][0]


@contextlib.asynccontextmanager
async def running(kind: str, policy: str, tokenize: str) -> AsyncIterator[Router]:
    """Two workers and the router as the real-worker study starts it
    (cachepilot.tooling.llamacpp.routers: its defaults, a free port)."""
    _need(kind)
    workers = Workers(tokenize)
    await workers.start()
    port, metrics = free_port(), free_port()
    sub = ["launch"] if kind == "sglang" else []
    quiet = "warn" if kind == "sglang" else "warning"
    proc = subprocess.Popen(
        [str(_launcher(kind)), *sub, "--host", "127.0.0.1", "--port", str(port),
         "--worker-urls", *workers.urls, "--policy", policy, "--prometheus-port",
         str(metrics), "--prometheus-host", "127.0.0.1", "--log-level", quiet],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as http:
            router = Router(f"http://127.0.0.1:{port}", http, workers)

            async def serving() -> bool:
                assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(f"{router.base}/v1/models") as r:
                        return r.status == 200
                return False

            await eventually(serving, timeout=30, interval=0.1, retry_on=(),
                             what=f"{kind}-router serving")
            # Its first health checks: every worker has been asked.
            await eventually(lambda: workers.health_checked == set(workers.names),
                             what=f"{kind}-router's health check of every worker")
            try:
                yield router
            finally:
                workers.release.set()
                await asyncio.gather(*router.held, return_exceptions=True)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        await workers.stop()


async def test_sglang_sends_a_novel_prompt_to_the_least_loaded_worker() -> None:
    """sglang-router 0.3.2 (PR #14650): low match → least loaded, not the smallest tree."""
    rng = random.Random(24)
    async with running("sglang", "cache_aware", "llama") as r:
        big = await r.send(text(rng, 4000))  # its tree is now the biggest by far
        small = r.workers.other(big)
        first = text(rng, 300)
        if await r.hold(first) == big:  # loads 1/0: the next novel prompt goes to small
            first = text(rng, 300)
            assert await r.hold(first) == small
        assert await r.hold(first + text(rng, 20)) == small  # a match: its holder
        # small is busier (2 in flight against at most 1) and has the smaller tree.
        for _ in range(3):
            assert await r.send(text(rng, 300)) == big


async def test_vllm_router_has_no_affinity_without_vllm_tokenize() -> None:
    """vllm-router 0.1.17 in front of llama-server-like workers: every request lacks
    tokens, so the least-loaded worker takes it, whatever the other holds."""
    rng = random.Random(25)
    async with running("vllm", "cache_aware", "llama") as r:
        doc = text(rng, 4000)
        holder = await r.hold(doc)
        assert await r.send(doc + text(rng, 20)) == r.workers.other(holder)


async def test_vllm_router_follows_its_tree_with_vllm_tokenize() -> None:
    """The same router in front of workers that tokenise as vLLM does: the holder keeps
    its prefix though busier; a novel prompt goes to the least loaded."""
    rng = random.Random(26)
    async with running("vllm", "cache_aware", "vllm") as r:
        doc = text(rng, 4000)
        holder = await r.hold(doc)
        assert await r.send(doc + text(rng, 20)) == holder
        assert await r.send(text(rng, 300)) == r.workers.other(holder)
