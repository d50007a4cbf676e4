"""Waiting for a condition instead of for a fixed time: the shared machines are too noisy
for fixed sleeps, and a pass returns as soon as the condition holds.

* :func:`until`: outside an event loop (threads, subprocesses, HTTP to a local stack).
* :func:`eventually`: inside one; the check may be a coroutine function.
* :func:`seconds_until`: the same, returning how long it took (for tests that bound it).
* :func:`holds_for`: the opposite, for what must NOT happen within an explicit window.

A check that raises one of ``retry_on`` is retried as not yet true (its error is in the
failure message); any other exception fails at once. :func:`until` retries no exception by
default, so an ``assert`` inside its check (say, that a process is still alive) fails fast;
:func:`eventually` retries the lookups and assertions of a state still being built.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

RETRY_ASYNC: tuple[type[BaseException], ...] = (AssertionError, KeyError, IndexError,
                                                 TypeError)


def until(check: Callable[[], Any], timeout: float = 10.0, what: str = "condition",
          interval: float = 0.02,
          retry_on: tuple[type[BaseException], ...] = ()) -> Any:
    """Poll ``check`` until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout
    while True:
        error: BaseException | None = None
        try:
            if result := check():
                return result
        except retry_on as e:
            error = e
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met in {timeout}s" + (f": {error!r}" if error
                                                                    else ""))
        time.sleep(interval)


async def eventually(check: Callable[[], Any], timeout: float = 10.0, what: str = "condition",
                     interval: float = 0.02,
                     retry_on: tuple[type[BaseException], ...] = RETRY_ASYNC) -> Any:
    """Poll ``check`` (a function, or a coroutine function) until it returns something
    truthy without raising, and return that. The timeout is generous: a pass returns early."""
    deadline = time.monotonic() + timeout
    while True:
        error: BaseException | None = None
        try:
            result = check()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return result
        except retry_on as e:
            error = e
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met in {timeout}s: {error!r}")
        await asyncio.sleep(interval)


async def seconds_until(check: Callable[[], Any], timeout: float = 10.0,
                        what: str = "condition", interval: float = 0.01) -> float:
    """Seconds until ``check()`` is truthy (polled every ``interval``); fails past
    ``timeout``. For tests that bound how fast something converges."""
    t0 = time.monotonic()
    await eventually(check, timeout, what, interval, retry_on=())
    return time.monotonic() - t0


async def holds_for(check: Callable[[], Any], seconds: float, what: str) -> None:
    """Assert ``check`` stays truthy for ``seconds``, polling. For what must NOT happen: no
    wait can prove a negative, so the window is an explicit bound, failing at the first
    violation instead of after a sleep."""
    deadline = time.monotonic() + seconds
    while True:
        assert check(), f"{what}: broken after {seconds - (deadline - time.monotonic()):.2f}s"
        if time.monotonic() >= deadline:
            return
        await asyncio.sleep(0.02)
