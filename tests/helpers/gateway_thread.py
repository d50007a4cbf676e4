"""Run a Gateway in a background thread's event loop, so a test can reach into its router."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from cachepilot.core.router import Router
from cachepilot.gateway.server import Gateway, GatewayConfig

T = TypeVar("T")


class GatewayThread:
    def __init__(self, router: Router, config: GatewayConfig) -> None:
        self.gateway = Gateway(router, config)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> GatewayThread:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.gateway.start(), self.loop).result(10)
        return self

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the gateway's loop (the router is single-threaded by design)."""
        async def run() -> T:
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def __exit__(self, *exc: Any) -> None:
        asyncio.run_coroutine_threadsafe(self.gateway.stop(), self.loop).result(20)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
