"""vLLM's KV-event wire formats, every one it has shipped, read per batch and told apart.

The transport never changed: ZMQ multipart ``[topic, seq (8 bytes big-endian), payload]``,
the payload msgpack of an array-like ``KVEventBatch`` (``vllm/distributed/kv_events.py``).
What changed is inside, one appended field at a time (upstream commits; each generation's
structs are in tests/data/vllm_kv_event_vectors.json with a test vector):

====  ==========================  =========================================================
gen   upstream commit (PR, date)  the wire
====  ==========================  =========================================================
G1    0be6d05b (#16750, 2025-04)  batch ``[ts, events]``; events positional arrays
                                  ``["BlockStored", hashes, parent, token_ids, block_size,
                                  lora_id]``, ``["BlockRemoved", hashes]``,
                                  ``["AllBlocksCleared"]``
G2    b712be98 (#18925, 2025-06)  batch ``[ts, events, data_parallel_rank]``
G3    14b4326b (#19737, 2025-09)  ``medium`` appended to both block events; 82dfb12e
                                  (#23673, vLLM 0.10.2) made hashes the digest's low 64 bits
                                  (or its 32 bytes)
G4    39512aba (#27577, 2025-12)  BlockStored ``lora_name``
G5    a0fe7ea2 (#33304, 2026-02)  BlockStored ``extra_keys``
G6    cc07dad7 (#37688, 2026-04)  ``group_idx`` on both
G7    bcb9c133 (#40984, 2026-05)  BlockStored ``kv_cache_spec_kind``, ``…_sliding_window``
G8    5b3807e8 (#42892, 2026-06)  events become maps tagged ``"type"`` (the batch stays an
                                  array); later fields (``locality`` #48281, ``ownership``,
                                  ``session_id`` #51381: vLLM 0.32.0) only add keys
====  ==========================  =========================================================

Fields only ever get appended, so a positional event is read by index whatever its
generation, and a map by name; trailing fields at their default may be left out (msgspec's
``omit_defaults``), so an array's length gives a lower bound on its generation. An event
this cannot read (an unknown type, a wrong shape, an absurd size) is not dropped silently:
it becomes :class:`~cachepilot.core.kv_events.Unreadable`, which the stream applies as a
hole in the worker's history (degraded), and it is counted and shown in ``/workers``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec

from cachepilot.core.fingerprint import external_hash
from cachepilot.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    Unreadable,
)

MAX_BLOCKS_PER_EVENT = 1 << 16  # 2M tokens at block size 32: more is not an engine's event
MAX_EVENTS_PER_BATCH = 1 << 16
U64 = 0xFFFF_FFFF_FFFF_FFFF

# Positions in an array-like event (the tag first): fields were only ever appended.
STORED_AT = {"block_hashes": 1, "parent_block_hash": 2, "token_ids": 3, "block_size": 4,
             "lora_id": 5, "medium": 6, "lora_name": 7, "extra_keys": 8, "group_idx": 9,
             "kv_cache_spec_kind": 10, "kv_cache_spec_sliding_window": 11}
REMOVED_AT = {"block_hashes": 1, "medium": 2, "group_idx": 3}
STORED_REQUIRED = 5  # block_hashes … lora_id have no default: always on the wire

# BlockStored fields on the wire (an array's length - 1) → the earliest generation that
# sends that many, and where it comes from.
ARRAY_GENERATIONS = ((5, "G1", "vLLM PR #16750 (0be6d05b)"),
                     (6, "G3", "vLLM PR #19737 (14b4326b)"),
                     (7, "G4", "vLLM PR #27577 (39512aba)"),
                     (8, "G5", "vLLM PR #33304 (a0fe7ea2)"),
                     (9, "G6", "vLLM PR #37688 (cc07dad7)"),
                     (10, "G7", "vLLM PR #40984 (bcb9c133)"))
MAP_GENERATION = ("G8", "vLLM PR #42892 (5b3807e8) and later, vLLM 0.32.0 included")


class MalformedBatch(ValueError):
    """The payload is not a KV-event batch at all (counted; the batch is missing)."""


@dataclass(frozen=True, slots=True)
class WireFormat:
    """What one batch looked like: positional or map events, the batch's field count, and
    the widest positional BlockStored (None: maps, or no BlockStored in it)."""

    events: str  # "array", "map", or "none" (an empty batch)
    batch_fields: int
    stored_fields: int | None = None

    def merged(self, earlier: WireFormat | None) -> WireFormat:
        """This batch's format with what earlier batches of the stream showed (the widest
        BlockStored seen so far says the most about the generation)."""
        if self.events == "none":
            return earlier or self
        if earlier is None or earlier.events != self.events:
            return self
        widths = [f for f in (self.stored_fields, earlier.stored_fields) if f is not None]
        return WireFormat(self.events, self.batch_fields, max(widths, default=None))

    def generation(self) -> tuple[str, str]:
        """The earliest generation that sends what was seen, and its upstream commit."""
        if self.events == "map":
            return MAP_GENERATION
        if self.events != "array":
            return "?", "no event seen yet"
        if self.stored_fields is None:
            return ("G1" if self.batch_fields == 2 else "G2+",
                    "positional events (no BlockStored seen yet)")
        _, gen, since = ARRAY_GENERATIONS[0]
        for fields, g, s in ARRAY_GENERATIONS:
            if self.stored_fields >= fields:
                gen, since = g, s
        if gen == "G1" and self.batch_fields == 3:
            gen, since = "G2", "vLLM PR #18925 (b712be98)"
        return gen, since

    def status(self) -> dict[str, Any]:
        gen, since = self.generation()
        return {"events": self.events, "batch_fields": self.batch_fields,
                "stored_fields": self.stored_fields, "generation": gen, "since": since}


def _hash(x: Any) -> int:
    if isinstance(x, bool):
        raise ValueError("a boolean block hash")
    if isinstance(x, int):
        return x & U64  # a signed builtin hash (before #23673) maps to its two's complement
    if isinstance(x, bytes | bytearray | memoryview):
        return external_hash(bytes(x))
    raise ValueError(f"a block hash of type {type(x).__name__}")


def _hashes(raw: Any) -> tuple[int, ...]:
    if not isinstance(raw, list | tuple):
        raise ValueError("block_hashes is not a list")
    if len(raw) > MAX_BLOCKS_PER_EVENT:
        raise ValueError(f"{len(raw)} blocks in one event")
    return tuple(_hash(h) for h in raw)


def _opt(value: Any, kind: type) -> Any:
    if value is None or (isinstance(value, kind) and not isinstance(value, bool)):
        return value
    raise ValueError(f"expected {kind.__name__} or nil, got {type(value).__name__}")


def _field(ev: Any, name: str, at: dict[str, int]) -> Any:
    if isinstance(ev, dict):
        return ev.get(name)
    i = at[name]
    return ev[i] if i < len(ev) else None


def decode_event(ev: Any) -> KVEvent:
    """One event, positional or map, as a core event; :class:`Unreadable` if it is not one
    of vLLM's three."""
    try:
        if isinstance(ev, dict):
            tag = ev.get("type")
        elif isinstance(ev, list | tuple) and ev:
            tag = ev[0]
        else:
            raise ValueError("not an array or a map")
        if tag == "BlockStored":
            if isinstance(ev, list | tuple) and len(ev) - 1 < STORED_REQUIRED:
                raise ValueError(f"BlockStored with {len(ev) - 1} fields")
            if isinstance(ev, dict) and "block_hashes" not in ev:
                raise ValueError("BlockStored without block_hashes")
            parent = _field(ev, "parent_block_hash", STORED_AT)
            return BlockStored(_hashes(_field(ev, "block_hashes", STORED_AT)),
                               None if parent is None else _hash(parent),
                               _opt(_field(ev, "block_size", STORED_AT), int) or None,
                               _opt(_field(ev, "group_idx", STORED_AT), int),
                               _opt(_field(ev, "kv_cache_spec_kind", STORED_AT), str),
                               _opt(_field(ev, "medium", STORED_AT), str))
        if tag == "BlockRemoved":
            if isinstance(ev, dict) and "block_hashes" not in ev:
                raise ValueError("BlockRemoved without block_hashes")
            return BlockRemoved(_hashes(_field(ev, "block_hashes", REMOVED_AT)),
                                _opt(_field(ev, "group_idx", REMOVED_AT), int),
                                _opt(_field(ev, "medium", REMOVED_AT), str))
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
        raise ValueError(f"unknown event type {str(tag)[:40]!r}")
    except (ValueError, IndexError, TypeError) as exc:
        return Unreadable(str(exc)[:120])


def _stored_fields(events: Sequence[Any]) -> int | None:
    widths = [len(e) - 1 for e in events
              if isinstance(e, list | tuple) and e and e[0] == "BlockStored"]
    return max(widths, default=None)


class Decoded(NamedTuple):
    events: list[KVEvent]  # unreadable ones as Unreadable, in place
    format: WireFormat
    ts: float  # the batch's timestamp, the engine's clock


def decode_batch(payload: bytes) -> Decoded:
    """A payload's events as core events, the format it came in and its timestamp. Raises
    :class:`MalformedBatch` if it is not a batch (then it counts as missing: the next batch
    shows the gap)."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, ValueError) as exc:
        raise MalformedBatch(f"not msgpack: {exc}") from None
    if (not isinstance(batch, list) or len(batch) not in (2, 3)
            or not isinstance(batch[0], int | float) or not isinstance(batch[1], list)):
        raise MalformedBatch("not a [ts, events(, dp_rank)] batch")
    raw = batch[1]
    if len(raw) > MAX_EVENTS_PER_BATCH:
        raise MalformedBatch(f"{len(raw)} events in one batch")
    kind = "none"
    if raw:
        kind = "map" if isinstance(raw[0], dict) else "array"
    fmt = WireFormat(kind, len(batch), _stored_fields(raw) if kind == "array" else None)
    return Decoded([decode_event(e) for e in raw], fmt, float(batch[0]))
