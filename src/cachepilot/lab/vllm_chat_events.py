"""The chat study's own subscriber to the workers' KV events
(:mod:`cachepilot.lab.vllm_chat_study`): every batch as this process receives it, and
:func:`diagnose`, which explains a wrong hit prediction from them."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from cachepilot.records.schema import record_hashes


@dataclass(frozen=True)
class Logged:
    worker: str
    received: float  # time.time() here
    ts: float  # the batch's timestamp (the engine's time.time())
    kind: str  # BlockStored, BlockRemoved, AllBlocksCleared
    hashes: frozenset[int]


class EventLog:
    """Every KV-event batch the workers publish, as this process receives it (a subscriber
    of its own beside the gateway's), for :func:`diagnose`."""

    def __init__(self) -> None:
        self.entries: list[Logged] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._ctx: Any = None

    def start(self, endpoints: dict[str, str], topic: str = "kv-events") -> None:
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        for worker, endpoint in endpoints.items():
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
            sock.connect(endpoint)
            self._tasks.append(asyncio.get_running_loop().create_task(self._read(worker,
                                                                                  sock)))

    async def _read(self, worker: str, sock: Any) -> None:
        from cachepilot.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
        from cachepilot.datalayer.kv_wire import MalformedBatch, decode_batch

        try:
            while True:
                frames = await sock.recv_multipart()
                now = time.time()
                try:
                    events, _, ts = decode_batch(frames[-1])
                except MalformedBatch:
                    continue
                for e in events:
                    if isinstance(e, BlockStored | BlockRemoved):
                        self.entries.append(Logged(worker, now, ts, type(e).__name__,
                                                   frozenset(e.hashes)))
                    elif isinstance(e, AllBlocksCleared):
                        self.entries.append(Logged(worker, now, ts, "AllBlocksCleared",
                                                   frozenset()))
        finally:
            sock.close(0)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)


def diagnose(record: dict[str, Any], predicted_tokens: int, measured: int, worker: str,
             log: list[Logged], block_size: int) -> str:
    """Why the gateway's hit prediction (its decision ``record``) was wrong, from the
    engine's events: when the blocks it counted on (a false hit) or the first block the
    engine had (a missed hit) were announced, relative to the routing decision."""
    t = float(record["time"])
    hashes = record_hashes(record)
    mine = [e for e in log if e.worker == worker]

    def last_before(h: int) -> Logged | None:
        return next((e for e in reversed(mine) if e.received <= t
                     and (h in e.hashes or e.kind == "AllBlocksCleared")), None)

    def first_after(h: int, kind: str) -> Logged | None:
        return next((e for e in mine if e.received > t and e.kind == kind and h in e.hashes),
                    None)

    if predicted_tokens > 0 and measured == 0:  # a false hit: the first block was gone
        h = hashes[0]
        before = last_before(h)
        if before is None:
            held = "pending (routed, not announced)"
        elif before.kind == "BlockStored":
            held = f"announced {t - before.received:.2f} s before"
        else:  # the engine had said it was gone: the gateway should have known
            return (f"false hit: block 0's {before.kind} came {t - before.received:.2f} s "
                    "before the decision")
        gone = first_after(h, "BlockRemoved")
        if gone is None:
            return f"false hit: block 0 {held}; no removal of it seen after the decision"
        return (f"false hit: block 0 {held}; its BlockRemoved came {gone.received - t:+.2f} s "
                f"after the decision (engine step stamped {gone.ts - t:+.2f} s): evicted by "
                "a step the gateway had not heard of yet")
    if predicted_tokens == 0 and measured > 0:  # a missed hit
        n = measured // block_size
        h = hashes[max(0, n - 1)] if hashes else 0
        before = last_before(h)
        if before is not None and before.kind == "BlockStored":
            return (f"missed hit: block {n - 1} was announced {t - before.received:.2f} s "
                    "before the decision")
        stored = first_after(h, "BlockStored")
        if stored is None:
            return f"missed hit: block {n - 1} never announced"
        return (f"missed hit: block {n - 1} announced {stored.received - t:+.2f} s after the "
                f"decision (engine step stamped {stored.ts - t:+.2f} s): stored by a request "
                "the gateway had not routed or not heard of yet")
    return ""
