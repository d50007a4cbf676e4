"""An engine's KV-cache event stream, kept in order and applied to the directory (pure).

vLLM's publisher numbers its batches 0, 1, 2, … on a ZMQ PUB socket and keeps the last
``buffer_steps`` (10,000 by default) for replay on a ROUTER socket: ask with a start number,
get every buffered batch from there, then an end marker. What a subscriber can miss, and
what :class:`EventStream` does about it (the adapter, ``datalayer/kv_events.py``, does the
I/O and calls it on its own clock):

- a gap in the numbers (PUB drops at its high-water mark, a slow subscriber): hold the
  later batches, replay from the first missing one, apply in order;
- a late join (gateway restart, or a worker attached after it started): replay from 0;
  if batch 0 is still buffered, the history is complete;
- a gap replay cannot fill (the buffer moved on, no replay endpoint, no answer): the event
  set may hold blocks evicted meanwhile, so it is dropped and the stream restarts from the
  next batch: mode ``degraded`` (only blocks stored since are certain);
- a publisher restart (numbers go back to 0 on the live socket, which never repeats one):
  a restarted engine's cache is empty, so the set is cleared;
- silence: vLLM publishes nothing while idle or on pure cache hits, so silence alone says
  nothing. A replay request from the next expected number doubles as a heartbeat (an idle
  publisher answers with just the end marker) and as a catch-up for a lost tail. No answer
  for ``stale_after`` seconds → ``approximate``: the set is dropped, routing falls back to
  the routing-learned directory, and the stream rejoins when the publisher answers again.

Only events about the full-attention KV groups say what a prefix hit saves (vLLM with
``--disable-hybrid-kv-cache-manager`` has one group; otherwise sliding-window groups publish
too, keeping only the last few blocks), and only the device tier (medium ``GPU`` or absent)
is what a request reuses: other events are counted and ignored.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from cachepilot.core.directory import APPROXIMATE, DEGRADED, EXACT, Mode, PrefixDirectory

# Kinds of KV group whose blocks a later request's prefix reuses in full (vLLM's
# KVCacheSpecKind values); an event without a kind comes from a single-group engine.
FULL_ATTENTION_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
DEVICE_MEDIA = frozenset({None, "GPU"})


@dataclass(frozen=True, slots=True)
class BlockStored:
    hashes: tuple[int, ...]
    parent: int | None = None
    block_size: int | None = None
    group: int | None = None
    kind: str | None = None
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    hashes: tuple[int, ...]
    group: int | None = None
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


@dataclass(frozen=True, slots=True)
class Unreadable:
    """An event the adapter could not read (an unknown type or shape: a wire format it does
    not know). Whatever it said is lost, so it is applied as a hole in the history."""

    reason: str = ""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared | Unreadable
Batch = tuple[int, Sequence[KVEvent]]  # (sequence number, events)


@dataclass(slots=True)
class StreamCounters:
    batches: int = 0  # applied
    events: int = 0  # applied
    ignored_events: int = 0  # other KV groups or media
    gaps: int = 0  # sequence gaps seen on the live socket
    late_joins: int = 0  # first batch seen was not number 0
    replays: int = 0  # replay requests (gap fills, late joins, heartbeats)
    replayed_batches: int = 0  # batches a replay brought in
    holes: int = 0  # gaps no replay could fill
    restarts: int = 0  # publisher restarts (numbers went back)
    stale: int = 0  # fallbacks to approximate after silence
    dropped_pending: int = 0  # live batches dropped while a replay was awaited (overflow)
    malformed: int = 0  # frames or events the adapter could not decode (it counts them)
    unreadable: int = 0  # Unreadable events applied (each a hole: degraded)
    engine_restarts: int = 0  # restarts the worker's scrape saw (the directory's epoch)


@dataclass(slots=True)
class EventStream:
    """One worker's event stream, applied to ``directory`` in sequence order.

    The adapter calls :meth:`on_live` per live batch, :meth:`replay_wanted` on every tick
    (and sends the request it names), :meth:`on_replay` with a replay's answer (``ended``
    False if it timed out), and :meth:`on_silence_check` on its clock.
    """

    directory: PrefixDirectory
    worker: str
    stale_after: float = 10.0  # s without any answer from the publisher → approximate
    heartbeat_every: float = 2.0  # s of silence before a replay request checks the publisher
    replay_timeout: float = 2.0  # s to wait for a replay's end marker
    max_pending: int = 4096  # live batches held while a replay is awaited
    can_replay: bool = True  # the publisher has a replay endpoint
    # Routed blocks not yet announced count as held for one to two of these periods (s):
    # longer than a prefill takes on the engine (sub-second on a GPU, ~10 s on this CPU).
    pending_every: float = 5.0
    counters: StreamCounters = field(default_factory=StreamCounters)
    next_seq: int | None = None  # the next number to apply; None: no position yet
    complete: bool = False  # the applied history starts at the engine's start or a clear
    last_heard: float | None = None
    replay_from: int | None = None  # a replay in flight, from this number
    replay_sent: float = 0.0
    pending: dict[int, Sequence[KVEvent]] = field(default_factory=dict)
    # group_idx → kind, learned from BlockStored (BlockRemoved carries only the group).
    groups: dict[int, str | None] = field(default_factory=dict)
    last_aged: float | None = None
    last_error: str | None = None  # the last Unreadable event's reason
    zero_ts: float | None = None  # the timestamp of the publisher's batch 0 (note_ts)
    # The directory's restart count for this worker when the stream last looked: a scrape
    # that finds a new engine process bumps it (PrefixDirectory.restarted).
    epoch: int = 0

    def __post_init__(self) -> None:
        self.directory.set_mode(self.worker, APPROXIMATE)
        self.epoch = self.directory.epoch(self.worker)

    # -- what the adapter calls ------------------------------------------------------------
    @property
    def mode(self) -> Mode:
        return self.directory.mode(self.worker) or APPROXIMATE

    def on_live(self, seq: int, events: Sequence[KVEvent], now: float) -> None:
        self._check_epoch(now)
        self.last_heard = now
        if self.next_seq is not None and seq < self.next_seq:
            # The live socket never repeats a number: the publisher restarted, and a
            # restarted engine's cache is empty. (A gap goes forward: held and replayed.)
            self.counters.restarts += 1
            self._reset(clear=True)
        if self.next_seq is None:
            if seq == 0:
                self._start(complete=True)
                self._apply(0, events)
                return
            if self.replay_from is None:
                self.counters.late_joins += 1
            self._hold(seq, events)
            if not self.can_replay:
                self._fill(ended=True)
            return
        if seq == self.next_seq and not self.pending:
            self._apply(seq, events)
            return
        if seq > self.next_seq and self.replay_from is None and seq not in self.pending:
            self.counters.gaps += 1
        self._hold(seq, events)
        if self.replay_from is None and self.next_seq in self.pending:
            self._drain()
        elif not self.can_replay:
            self._fill(ended=True)

    def note_ts(self, seq: int, ts: float) -> None:
        """A decoded batch's timestamp (the engine's clock). Batch 0's tells a restart seen
        by its events from one a later scrape sees (PrefixDirectory.restarted)."""
        if seq == 0:
            self.zero_ts = ts

    def replay_wanted(self, now: float) -> int | None:
        """A replay start number to request now, or None. Marks it in flight."""
        self._check_epoch(now)
        if not self.can_replay:
            return None
        if self.replay_from is not None:
            if now - self.replay_sent < self.replay_timeout:
                return None
            self.on_replay([], ended=False, now=now)  # timed out: what we hold is all
        want = None
        if self.pending:  # a gap or a late join
            want = self.next_seq if self.next_seq is not None else 0
        elif self.last_heard is None or now - self.last_heard >= self.heartbeat_every:
            want = self.next_seq if self.next_seq is not None else 0  # heartbeat / first join
        if want is None:
            return None
        self.replay_from, self.replay_sent = want, now
        self.counters.replays += 1
        return want

    def on_replay(self, batches: Iterable[Batch], *, ended: bool, now: float) -> None:
        """A replay's answer: its batches (numbers ≥ the start asked for) and whether the
        end marker came (False: timed out). Fills what it can; a hole it leaves is final."""
        start, self.replay_from = self.replay_from, None
        got = 0
        for seq, events in batches:
            got += 1
            if self.next_seq is None or seq >= self.next_seq:
                self.pending.setdefault(seq, events)
        self.counters.replayed_batches += got
        if ended:
            self.last_heard = now
        if start is None or (not ended and not self.pending):
            return
        self._fill(ended=ended)

    def on_silence_check(self, now: float) -> None:
        """Fall back to approximate when the publisher has not answered for ``stale_after``
        (only with a replay endpoint: without one, vLLM's idle silence looks the same), and
        age the directory's pending (routed, unannounced) blocks."""
        self._check_epoch(now)
        if self.last_aged is None:
            self.last_aged = now
        elif now - self.last_aged >= self.pending_every:
            self.directory.age_pending(self.worker)
            self.last_aged = now
        if (self.can_replay and self.last_heard is not None
                and now - self.last_heard > self.stale_after and self.mode != APPROXIMATE):
            self.counters.stale += 1
            self._reset(clear=False)
            self.last_heard = None  # rejoin (replay from 0) once it answers

    # -- internals ----------------------------------------------------------------------------
    def _check_epoch(self, now: float) -> None:
        """The worker's scrape saw a new engine process (PrefixDirectory.restarted, which
        already emptied its sets): its publisher starts again at 0, with an empty cache.
        So the history is complete and empty; the new publisher's first batch is 0 (a later
        first number is a gap, replayed from 0)."""
        epoch = self.directory.epoch(self.worker)
        if epoch == self.epoch:
            return
        self.counters.engine_restarts += epoch - self.epoch
        self.epoch = epoch
        self._reset(clear=False)
        self._start(complete=True)
        self.last_heard = now  # silence is judged from here

    def _fill(self, *, ended: bool) -> None:
        """Apply held batches from ``next_seq`` on, starting after a hole where one is left."""
        if self.next_seq is None:
            if not self.pending:
                if ended:  # the publisher has published nothing yet: an empty, fresh engine
                    self._start(complete=True)
                return
            first = min(self.pending)
            if first == 0:
                self._start(complete=True)
            else:  # the history before ``first`` is lost: a mid-stream start
                self.counters.holes += 1
                self._start(complete=False, at=first)
        elif self.pending and self.next_seq not in self.pending:
            self.counters.holes += 1
            # Missed removals would leave evicted blocks in the set: drop it, restart after.
            self.directory.set_mode(self.worker, APPROXIMATE)
            self._start(complete=False, at=min(self.pending))
        self._drain()

    def _drain(self) -> None:
        while self.next_seq is not None and self.next_seq in self.pending:
            seq = self.next_seq
            self._apply(seq, self.pending.pop(seq))
        if self.pending and self.replay_from is None and not self.can_replay:
            self._fill(ended=True)

    def _start(self, *, complete: bool, at: int = 0) -> None:
        self.next_seq, self.complete = at, complete
        # A fresh event set; the routing-learned set stays as the fallback's warm start.
        self.directory.set_mode(self.worker, APPROXIMATE)
        self.directory.set_mode(self.worker, EXACT if complete else DEGRADED)

    def _reset(self, *, clear: bool) -> None:
        if clear:
            self.directory.cleared(self.worker)
        self.directory.set_mode(self.worker, APPROXIMATE)
        self.next_seq, self.complete, self.replay_from = None, False, None
        self.pending.clear()
        self.groups.clear()

    def _hold(self, seq: int, events: Sequence[KVEvent]) -> None:
        if len(self.pending) >= self.max_pending and seq not in self.pending:
            self.counters.dropped_pending += 1
            return
        self.pending[seq] = events

    def _apply(self, seq: int, events: Sequence[KVEvent]) -> None:
        d, w, c = self.directory, self.worker, self.counters
        for ev in events:
            if isinstance(ev, BlockStored):
                if ev.group is not None:
                    self.groups[ev.group] = ev.kind
                if ev.medium not in DEVICE_MEDIA or (ev.kind is not None
                                                      and ev.kind not in FULL_ATTENTION_KINDS):
                    c.ignored_events += 1
                    continue
                d.stored(w, ev.hashes)
            elif isinstance(ev, BlockRemoved):
                kind = self.groups.get(ev.group) if ev.group is not None else None
                if ev.medium not in DEVICE_MEDIA or (kind is not None
                                                      and kind not in FULL_ATTENTION_KINDS):
                    c.ignored_events += 1
                    continue
                d.removed(w, ev.hashes)
            elif isinstance(ev, Unreadable):
                # Whatever it said (a removal?) is lost: the set can no longer be trusted
                # whole. Blocks stored from here on are certain: degraded, as after a hole.
                c.unreadable += 1
                self.last_error = f"batch {seq}: {ev.reason}"
                self.complete = False
                d.set_mode(w, APPROXIMATE)
                d.set_mode(w, DEGRADED)
                continue
            else:
                d.cleared(w)
                if not self.complete:  # the engine's truth is known again: empty
                    self.complete = True
                    d.set_mode(w, EXACT)
            c.events += 1
        c.batches += 1
        if seq == 0 and self.complete:  # the publisher's history from its very start
            d.events_fresh(w, self.zero_ts)
        self.next_seq = seq + 1

    def status(self) -> dict[str, object]:
        c = self.counters
        return {"mode": self.mode, "next_seq": self.next_seq, "complete": self.complete,
                "last_error": self.last_error,
                "pending": len(self.pending), "replay_in_flight": self.replay_from is not None,
                "event_blocks": len(self.directory.event_blocks(self.worker)),
                **{k: getattr(c, k) for k in c.__slots__}}
