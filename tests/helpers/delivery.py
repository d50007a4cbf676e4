"""Whether what gateway replicas (or one gateway's processes) send each other has arrived,
from their counters: each one's (sent, received from the others), read over HTTP one after
another."""

from __future__ import annotations

from collections.abc import Callable

from helpers.polling import until

Counts = list[tuple[int, int]]


def quiet(read: Callable[[], Counts], timeout: float = 10.0) -> Counts:
    """The counters once two readings in a row agree: nothing was in flight, so what one
    has received is all the others had sent (a reading taken while something travels
    would count it as sent on one side only, and :func:`delivered` wait for it forever)."""
    last: list[Counts] = []

    def check() -> Counts | None:
        now = read()
        same = bool(last) and now == last[-1]
        last.append(now)
        return now if same else None

    return until(check, timeout, "a moment with nothing in flight", interval=0.05)


def delivered(read: Callable[[], Counts], before: Counts, timeout: float = 10.0,
              what: str = "delivery") -> None:
    """Until something was sent since ``before`` (a quiet reading) and each one has
    received at least what the others sent since."""
    def check() -> bool:
        now = read()
        sent = [s - s0 for (s, _), (s0, _) in zip(now, before, strict=True)]
        assert sum(sent) and all(
            r - r0 >= sum(sent) - sent[i]
            for i, ((_, r), (_, r0)) in enumerate(zip(now, before, strict=True))), \
            f"{before} → {now}"
        return True

    until(check, timeout, what, retry_on=(AssertionError,))
