"""asyncio helpers for the operator's long-running loops.

Why not ``asyncio.wait_for``: on Python 3.11 it swallows a cancellation that arrives in
the same loop tick as the awaited call completes (CPython gh-86296, fixed in 3.12 by
re-implementing it on ``asyncio.timeout``). A loop that loses its cancellation never
ends, and the gateway's shutdown waits for it forever. ``asyncio.timeout`` counts
cancellations (``Task.uncancel``) and always lets an outside one through.
"""

from __future__ import annotations

import asyncio
import contextlib


async def wait_stopped(stop: asyncio.Event, seconds: float) -> bool:
    """Wait up to ``seconds`` for ``stop``; returns whether it is set."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await stop.wait()
    return stop.is_set()
