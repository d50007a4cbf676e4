"""A KV-event publisher with vLLM's wire format and replay protocol, for the simulated worker
and for fault drills: the gateway cannot tell it from ``vllm serve --kv-events-config``.

Like vLLM's ``ZmqEventPublisher``: a PUB socket sends ``[topic, seq (8 bytes big-endian),
msgpack KVEventBatch]``, every batch is kept in a bounded buffer, and a ROUTER socket
answers a replay request ``[b"", start]`` with ``[b"", topic, seq, payload]`` for every
buffered batch from ``start`` on, then ``[b"", b"", -1, b""]`` (vLLM 0.32's frames).
Events are encoded by msgspec with structs shaped like vLLM's (tagged maps, fields at their
default omitted; the batch an array).

Fault injection, for drills: :meth:`KVEventPublisher.drop_next` (batches numbered and
buffered but never sent live: a gap only replay can fill), :meth:`KVEventPublisher.restart`
(numbers from 0 and an empty buffer, as a restarted engine), and ``buffer_steps`` small
enough to make holes.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import zmq

from cachepilot.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _Stored(msgspec.Struct, tag="BlockStored", omit_defaults=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved", omit_defaults=True):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True):
    pass


def _wire(ev: KVEvent) -> msgspec.Struct:
    if isinstance(ev, BlockStored):
        return _Stored(list(ev.hashes), ev.parent, [], ev.block_size or 0, None,
                       ev.medium if ev.medium is not None else "GPU", None, ev.group,
                       ev.kind)
    if isinstance(ev, BlockRemoved):
        return _Removed(list(ev.hashes), ev.medium if ev.medium is not None else "GPU",
                        ev.group)
    if isinstance(ev, AllBlocksCleared):
        return _Cleared()
    raise TypeError(f"not a KV event: {ev!r}")


class KVEventPublisher:
    """Publish KV events on ``endpoint`` with replay on ``replay_endpoint``.

    Endpoints may use port ``*`` (``tcp://127.0.0.1:*``): :attr:`endpoint` and
    :attr:`replay_endpoint` then name the ports bound. Thread-safe: :meth:`publish` may be
    called from any one thread at a time (a lock serialises it); replay is served by a
    daemon thread of its own.
    """

    def __init__(self, endpoint: str = "tcp://127.0.0.1:*",
                 replay_endpoint: str | None = "tcp://127.0.0.1:*", *, topic: str = "kv-events",
                 buffer_steps: int = 10_000) -> None:
        self._ctx = zmq.Context()
        self._topic = topic.encode()
        self._encoder = msgspec.msgpack.Encoder()
        self._lock = threading.Lock()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._drop = 0
        self.replay_endpoint: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if replay_endpoint is not None:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self._router.bind(replay_endpoint)
                self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            # A taken port: close now, or the context's finaliser blocks whichever thread
            # the garbage collector next runs in (CI saw a 60-s stall in another test).
            self._ctx.destroy(linger=0)
            raise
        if replay_endpoint is not None:
            self._thread = threading.Thread(target=self._serve_replay, daemon=True,
                                            name="kv-event-replay")
            self._thread.start()
        self.replay_requests = 0
        self.answer_replays = True  # False: a publisher whose replay side hangs

    # -- publishing -------------------------------------------------------------------------
    def publish(self, events: Sequence[KVEvent], ts: float | None = None) -> int:
        """Send one batch; returns its sequence number."""
        return self.publish_payload(self._encoder.encode(
            _Batch(time.time() if ts is None else ts, [_wire(e) for e in events], 0)))

    def publish_payload(self, payload: bytes) -> int:
        """Send one batch already encoded (another vLLM release's wire format), numbered and
        kept for replay like any other; returns its sequence number."""
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
            if self._drop > 0:
                self._drop -= 1
            else:
                self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
        return seq

    def publish_raw(self, frames: Iterable[bytes]) -> None:
        """Send arbitrary frames (hostile-stream tests)."""
        with self._lock:
            self._pub.send_multipart(list(frames))

    def drop_next(self, n: int = 1) -> None:
        """Number and buffer the next ``n`` batches but never send them live."""
        with self._lock:
            self._drop += n

    def restart(self) -> None:
        """As a restarted engine: numbers from 0 again, nothing to replay."""
        with self._lock:
            self._seq = 0
            self._buffer.clear()
            self._drop = 0

    @property
    def next_seq(self) -> int:
        return self._seq

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._ctx.destroy(linger=0)

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- replay -----------------------------------------------------------------------------
    def _serve_replay(self) -> None:
        router = self._router
        while not self._stop.is_set():
            if not router.poll(50):
                continue
            frames = router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue
            self.replay_requests += 1
            if not self.answer_replays:
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            with self._lock:
                batches = [(s, p) for s, p in self._buffer if s >= start]
            for seq, payload in batches:
                router.send_multipart([client, b"", self._topic, seq.to_bytes(8, "big"),
                                       payload])
            router.send_multipart([client, b"", b"", END_SEQ, b""])


class EngineTap:
    """Publish a simulated engine's cache changes as KV events, with no hook in the engine:
    after each ``engine.step`` the hashed blocks it holds (in use or cached free) are compared
    with those before, and what appeared is a BlockStored, what went a BlockRemoved. One set
    difference per step (~50 µs for 8k blocks). A block evicted and stored again within one
    step is no change, which is also what the engine holds afterwards.

    Hook into the simulated worker (tooling/sim_worker.py): create it beside the engine and
    call :meth:`after_step` after every ``engine.step(...)``.
    """

    def __init__(self, engine: Any, publisher: KVEventPublisher, block_size: int) -> None:
        self.engine = engine
        self.publisher = publisher
        self.block_size = block_size
        self._held = self._blocks()

    def _blocks(self) -> set[int]:
        # The engine's own bookkeeping (sim/engine.py): hashed blocks in use and cached free.
        return set(self.engine._in_use) | set(self.engine._free_cached)

    def after_step(self) -> int | None:
        """Publish this step's changes; returns the batch's number, or None if none."""
        now = self._blocks()
        removed, stored = self._held - now, now - self._held
        self._held = now
        events: list[KVEvent] = []
        if removed:
            events.append(BlockRemoved(tuple(removed)))
        if stored:
            events.append(BlockStored(tuple(stored), block_size=self.block_size))
        return self.publisher.publish(events) if events else None
