"""Subscribe to each worker's KV-cache events (vLLM's ZMQ publisher) and keep the directory
exact: the I/O half of :mod:`cachepilot.core.kv_events`.

Transport (every vLLM release since the publisher's first, ``vllm/distributed/kv_events.py``,
``ZmqEventPublisher``):

- PUB: multipart ``[topic, seq (8 bytes big-endian), payload]``; ``payload`` is msgpack of a
  ``KVEventBatch``, whose events changed shape over the releases: every generation is read
  (:mod:`cachepilot.datalayer.kv_wire`) and the one a worker speaks is in ``/workers``.
  Block hashes are unsigned 64-bit ints (bytes when the engine has
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``: then their last 8 bytes count).
- ROUTER (replay): send ``[b"", start (8 bytes big-endian)]`` from a DEALER; the answer is
  ``[b"", topic, seq, payload]`` per buffered batch with ``seq ≥ start``, then
  ``[b"", b"", -1, b""]`` (since 2f3f441f, #45177; before it without the topic frame:
  both are read).

One :class:`KVEventHub` serves the gateway: :meth:`KVEventHub.attach` a worker (its
directory, PUB and replay endpoints), :meth:`KVEventHub.detach` it, read
:meth:`KVEventHub.status` for ``/workers`` and the metrics. It runs in the gateway's event
loop (``zmq.asyncio``), so the directory is only ever touched from that loop. A malformed or
hostile stream (garbage frames, unknown event types, absurd block counts, floods) is counted
and shown as the worker's ``error``; an event it cannot read is a hole in that worker's
history (degraded), never silently nothing. It can only cost its own worker its exactness.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from cachepilot.core.directory import PrefixDirectory
from cachepilot.core.kv_events import EventStream, KVEvent, Unreadable
from cachepilot.datalayer.kv_wire import MalformedBatch, WireFormat, decode_batch

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_FRAME_BYTES = 64 << 20  # ZMQ drops larger messages before we ever see them
RECV_BUDGET = 512  # messages per socket per loop turn: a flood cannot starve the gateway


# -- one worker's subscription --------------------------------------------------------------
@dataclass
class Endpoints:
    events: str  # the PUB endpoint, e.g. tcp://10.0.0.5:5557
    replay: str | None = None  # the ROUTER endpoint, e.g. tcp://10.0.0.5:5558
    topic: str = ""


@dataclass
class _Subscription:
    worker: str
    endpoints: Endpoints
    directory_of: Callable[[], PrefixDirectory]
    stream: EventStream
    task: asyncio.Task[None] | None = None
    malformed_frames: int = 0
    skipped_events: int = 0  # events decoded as Unreadable (live and replayed)
    connected_at: float = field(default_factory=time.monotonic)
    wire: WireFormat | None = None  # the wire format the publisher speaks, as seen so far
    error: str | None = None  # why the last frame or event could not be read; None: fine

    def decode(self, seq: int, payload: bytes) -> list[KVEvent] | None:
        """A payload's events (None: not a batch, counted as malformed), noting the wire
        format, any event it could not read and batch 0's timestamp."""
        try:
            events, fmt, ts = decode_batch(payload)
        except MalformedBatch as exc:
            self.malformed_frames += 1
            self.error = f"undecodable batch: {exc}"
            return None
        if fmt.events != "none" and (self.wire is None or fmt.events != self.wire.events):
            log.info("KV events of %s: %s", self.worker, fmt.generation()[1])
        self.wire = fmt.merged(self.wire)
        self.stream.note_ts(seq, ts)
        bad = [e.reason for e in events if isinstance(e, Unreadable)]
        if bad:
            self.skipped_events += len(bad)
            self.error = f"unreadable event: {bad[0]}"
        elif events:
            self.error = None
        return events


class KVEventHub:
    """Per-worker KV-event subscribers feeding the pools' directories.

    ``stream_options`` go to every :class:`EventStream` (``stale_after``, ``heartbeat_every``,
    ``replay_timeout``, ``max_pending``). ``tick`` is how often each subscriber checks its
    replay and silence timers.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, tick: float = 0.1,
                 **stream_options: Any) -> None:
        # Created at the first subscription: a gateway without KV events holds no ZMQ context
        # (an unterminated one can block the interpreter in its finalizer).
        self._ctx: zmq.asyncio.Context | None = None
        self._clock = clock
        self._tick = tick
        self._stream_options = stream_options
        self._subs: dict[str, _Subscription] = {}
        self._closed = False

    # -- the API the gateway calls ----------------------------------------------------------
    def attach(self, worker: str, endpoints: Endpoints,
               directory: PrefixDirectory | Callable[[], PrefixDirectory]) -> None:
        """Subscribe to ``worker``'s events (again, if its endpoints changed). Must be called
        from the running event loop that owns ``directory``."""
        old = self._subs.get(worker)
        if old is not None and old.endpoints == endpoints:
            return
        self.detach(worker)
        directory_of = directory if callable(directory) else (lambda: directory)
        stream = EventStream(directory_of(), worker, can_replay=endpoints.replay is not None,
                             **self._stream_options)
        sub = _Subscription(worker, endpoints, directory_of, stream)
        self._subs[worker] = sub
        sub.task = asyncio.get_running_loop().create_task(self._run(sub),
                                                          name=f"kv-events {worker}")

    def detach(self, worker: str) -> None:
        """Stop following ``worker``; its directory entry falls back to approximate."""
        sub = self._subs.pop(worker, None)
        if sub is None:
            return
        if sub.task is not None:
            sub.task.cancel()
        d = sub.directory_of()
        if worker in d:
            d.set_mode(worker, "approximate")

    def workers(self) -> list[str]:
        return list(self._subs)

    def mode(self, worker: str) -> str:
        sub = self._subs.get(worker)
        return sub.stream.mode if sub is not None else "approximate"

    def status(self) -> dict[str, dict[str, Any]]:
        """Per worker: mode, counters (gaps, replays, holes, restarts, stale, malformed…)
        and endpoints, for ``/workers`` and the metrics."""
        out = {}
        for w, sub in self._subs.items():
            st = sub.stream.status()
            st["malformed"] = sub.malformed_frames
            st["skipped_events"] = sub.skipped_events
            st["wire_format"] = sub.wire.status() if sub.wire is not None else None
            st["error"] = sub.error
            st["endpoint"] = sub.endpoints.events
            st["replay_endpoint"] = sub.endpoints.replay
            out[w] = st
        return out

    async def stop(self) -> None:
        for w in list(self._subs):
            sub = self._subs[w]
            self.detach(w)
            if sub.task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await sub.task
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
        self._closed = True

    # -- the loop ---------------------------------------------------------------------------
    def _socket(self, kind: int, endpoint: str) -> zmq.asyncio.Socket:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        s = self._ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        s.setsockopt(zmq.RCVHWM, 100_000)
        s.connect(endpoint)
        return s

    async def _run(self, sub: _Subscription) -> None:
        ep = sub.endpoints
        pub = self._socket(zmq.SUB, ep.events)
        pub.setsockopt(zmq.SUBSCRIBE, ep.topic.encode())
        dealer: zmq.asyncio.Socket | None = None
        replayed: list[tuple[int, list[KVEvent]]] = []
        in_flight = False
        poller = zmq.asyncio.Poller()
        poller.register(pub, zmq.POLLIN)
        try:
            while True:
                d = sub.directory_of()
                if d is not sub.stream.directory:  # the pool rebuilt its directory
                    sub.stream = EventStream(d, sub.worker, can_replay=ep.replay is not None,
                                             **self._stream_options)
                ready = dict(await poller.poll(timeout=int(self._tick * 1000)))
                now = self._clock()
                if pub in ready:
                    await self._drain_live(sub, pub, now)
                if dealer is not None and dealer in ready:
                    done = await self._drain_replay(sub, dealer, replayed)
                    if done:
                        sub.stream.on_replay(replayed, ended=True, now=self._clock())
                        replayed, in_flight = [], False
                now = self._clock()
                if in_flight and sub.stream.replay_from is None:
                    in_flight = False  # the stream gave up on it (timed out)
                want = sub.stream.replay_wanted(now)
                if want is not None and ep.replay is not None:
                    if in_flight or dealer is None:
                        # A fresh socket per abandoned request: late answers to it are dropped.
                        if dealer is not None:
                            poller.unregister(dealer)
                            dealer.close(linger=0)
                        dealer = self._socket(zmq.DEALER, ep.replay)
                        poller.register(dealer, zmq.POLLIN)
                        replayed = []
                    await dealer.send_multipart([b"", want.to_bytes(8, "big")])
                    in_flight = True
                sub.stream.on_silence_check(now)
        except asyncio.CancelledError:
            raise
        except Exception:  # never let one worker's stream take the gateway down
            log.exception("KV-event subscriber for %s failed", sub.worker)
            sub.stream.directory.set_mode(sub.worker, "approximate")
        finally:
            pub.close(linger=0)
            if dealer is not None:
                dealer.close(linger=0)

    async def _drain_live(self, sub: _Subscription, pub: zmq.asyncio.Socket,
                          now: float) -> None:
        for _ in range(RECV_BUDGET):
            try:
                frames = await pub.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[1]) != 8:
                sub.malformed_frames += 1
                sub.error = f"a live message of {len(frames)} frames, not [topic, seq, batch]"
                continue
            seq = int.from_bytes(frames[1], "big")
            events = sub.decode(seq, frames[2])
            if events is not None:
                sub.stream.on_live(seq, events, now)
        await asyncio.sleep(0)  # a flood: let the gateway's other work run

    async def _drain_replay(self, sub: _Subscription, dealer: zmq.asyncio.Socket,
                            into: list[tuple[int, list[KVEvent]]]) -> bool:
        """Read replay answers; True once the end marker came. vLLM 0.32 answers
        ``[b"", topic, seq, payload]`` (end: ``[b"", b"", -1, b""]``); earlier releases
        ``[b"", seq, payload]``: both are read."""
        for _ in range(RECV_BUDGET):
            try:
                frames = await dealer.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return False
            if len(frames) not in (3, 4) or frames[0] != b"" or len(frames[-2]) != 8:
                sub.malformed_frames += 1
                sub.error = f"a replay answer of {len(frames)} frames"
                continue
            seq_bytes, payload = frames[-2], frames[-1]
            if seq_bytes == END_SEQ:
                return True
            seq = int.from_bytes(seq_bytes, "big")
            events = sub.decode(seq, payload)
            if events is not None:
                into.append((seq, events))
        return False


EndpointsFor = Callable[[str, str], Endpoints | None]  # (pool name, worker address)


def port_endpoints(port: int = 5557, replay_port: int | None = 5558,
                   topic: str = "kv-events") -> EndpointsFor:
    """Every worker publishes on the same ports of its own host (a Kubernetes pod, or
    ``--kv-events-config`` with ``tcp://*:5557`` and ``replay_endpoint`` ``tcp://*:5558``)."""
    def endpoints(_pool: str, address: str) -> Endpoints:
        host = address.rsplit(":", 1)[0]
        return Endpoints(f"tcp://{host}:{port}",
                         f"tcp://{host}:{replay_port}" if replay_port else None, topic)
    return endpoints


def sync_pools(hub: KVEventHub, pools: Mapping[str, Any], endpoints_for: EndpointsFor) -> None:
    """Follow exactly the workers the pools have now (``router.pools``: each pool with
    ``.workers`` and ``.directory``): attach new ones, re-attach moved ones, detach gone ones.
    Call it from the gateway's loop whenever membership may have changed (or every second)."""
    wanted: dict[str, tuple[Endpoints, Callable[[], PrefixDirectory]]] = {}
    for name, pool in pools.items():
        for address in pool.workers:
            ep = endpoints_for(name, address)
            if ep is not None:
                wanted[address] = (ep, lambda pool=pool: pool.directory)
    for address in hub.workers():
        if address not in wanted:
            hub.detach(address)
    for address, (ep, directory_of) in wanted.items():
        hub.attach(address, ep, directory_of)


async def follow_pools(hub: KVEventHub, pools: Mapping[str, Any], endpoints_for: EndpointsFor,
                       every_s: float = 1.0) -> None:
    """:func:`sync_pools` every ``every_s`` for the gateway's lifetime (a task it cancels)."""
    while True:
        sync_pools(hub, pools, endpoints_for)
        await asyncio.sleep(every_s)
