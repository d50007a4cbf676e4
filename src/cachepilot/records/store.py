"""Decision log storage on LMDB: append-ordered records, outcomes merged by id, bounded.

Why LMDB (see docs/decisions.md): every write is a copy-on-write B+tree transaction, so a
commit is all or nothing: a killed process (or, with ``durable=True``, a power cut) leaves
the last committed state, never a torn record, with no recovery step and no log to replay.
Appends with strictly increasing keys (``MDB_APPEND``) fill pages sequentially, and many
records go in one transaction, so one fsync serves a whole batch. Readers in other processes
(``cachepilot explain`` while the gateway runs) never block the writer.

Layout, four named databases in one environment (a directory holding data.mdb, lock.mdb):

- ``records``: 8-byte big-endian key (wall-clock ns at write, strictly increasing) → the
  record as JSON. Key order is arrival order, and age retention is a range delete.
- ``ids``: decision id → record key.
- ``outcomes``: decision id → outcome JSON, merged with later reports of the same id.
- ``meta``: schema version.

Not thread-safe for writes: one writer thread (the recorder's) per log. Reads may come
from any thread or process.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import lmdb
import orjson

from cachepilot.records.schema import (
    READABLE_SCHEMAS,
    SCHEMA_VERSION,
    check_record,
    join,
    merge_outcome,
)

DEFAULT_MAX_BYTES = 512 << 20  # live data; the file may hold up to twice that (free pages)
DEFAULT_MAX_AGE_S = 7 * 86400.0
_KEY = struct.Struct(">Q")
_DBS = (b"records", b"ids", b"outcomes", b"meta")


class LogNotFoundError(FileNotFoundError):
    pass


@dataclass(slots=True)
class WriteResult:
    decisions: int = 0
    outcomes: int = 0
    orphan_outcomes: int = 0  # outcome for an id never written (its decision was dropped)


class Store:
    """One LMDB environment. ``readonly`` opens an existing log for reading only."""

    def __init__(self, path: str | os.PathLike[str], *, readonly: bool = False,
                 max_bytes: int = DEFAULT_MAX_BYTES, max_age_s: float | None = DEFAULT_MAX_AGE_S,
                 durable: bool = True) -> None:
        self.path = os.fspath(path)
        self.readonly = readonly
        self.max_bytes = int(max_bytes)
        self.max_age_s = max_age_s
        if readonly:
            if not os.path.exists(os.path.join(self.path, "data.mdb")):
                raise LogNotFoundError(f"no decision log at {self.path}")
            self.env = lmdb.open(self.path, readonly=True, max_dbs=len(_DBS), subdir=True,
                                 lock=True, readahead=False)
        else:
            os.makedirs(self.path, exist_ok=True)
            # Headroom over max_bytes: freed pages are reused only once no reader holds them.
            self.env = lmdb.open(self.path, map_size=2 * self.max_bytes + (64 << 20),
                                 max_dbs=len(_DBS), subdir=True, sync=durable,
                                 metasync=durable, readahead=False, lock=True)
            self.env.reader_check()  # clear reader slots of killed processes
        create = not readonly
        try:
            self._rec, self._ids, self._out, self._meta = (
                self.env.open_db(name, create=create) for name in _DBS)
        except lmdb.NotFoundError:
            self.env.close()
            raise LogNotFoundError(f"{self.path} is not a decision log") from None
        with self.env.begin(write=create) as txn:
            version = txn.get(b"schema_version", db=self._meta)
            if create and (version is None or (int(version) in READABLE_SCHEMAS
                                               and int(version) < SCHEMA_VERSION)):
                # New, or an older schema this code reads: every record names its own
                # schema, so new records go beside the old ones, and the log now says the
                # newest (an older cachepilot refuses it rather than misread new records).
                txn.put(b"schema_version", str(SCHEMA_VERSION).encode(), db=self._meta)
            elif version is not None and int(version) not in READABLE_SCHEMAS:
                raise ValueError(f"{self.path}: decision log schema {int(version)}; this "
                                 f"cachepilot writes {SCHEMA_VERSION} and reads "
                                 f"{', '.join(map(str, READABLE_SCHEMAS))}")
            cur = txn.cursor(db=self._rec)
            self._last_key = _KEY.unpack(cur.key())[0] if cur.last() else 0

    # -- writing (one thread) -------------------------------------------------------------
    def _next_key(self) -> bytes:
        self._last_key = max(time.time_ns(), self._last_key + 1)
        return _KEY.pack(self._last_key)

    def write(self, decisions: Iterable[dict[str, Any]] = (),
              outcomes: Iterable[tuple[str, Mapping[str, Any]]] = (),
              ops: Iterable[tuple[str, Any]] | None = None) -> WriteResult:
        """Write records and outcomes in one transaction: all of them are committed or none.
        ``ops`` (``("decision", record)`` / ``("outcome", (id, fields))``) keeps their order,
        so an outcome may follow its decision in the same batch."""
        if ops is None:
            ops = [("decision", r) for r in decisions] + [("outcome", o) for o in outcomes]
        ops = list(ops)
        last_key = self._last_key
        try:
            return self._write(ops)
        except lmdb.MapFullError:
            self._last_key = last_key
            self.prune(fraction=0.25)
            return self._write(ops)

    def _write(self, ops: list[tuple[str, Any]]) -> WriteResult:
        res = WriteResult()
        with self.env.begin(write=True) as txn:
            for kind, payload in ops:
                if kind == "decision":
                    rid = payload["id"].encode()
                    old = txn.get(rid, db=self._ids)
                    if old is not None:  # same id recorded again: keep the newest
                        txn.delete(old, db=self._rec)
                        txn.delete(rid, db=self._out)
                    key = self._next_key()
                    txn.put(key, orjson.dumps(payload, default=str), db=self._rec, append=True)
                    txn.put(rid, key, db=self._ids)
                    res.decisions += 1
                else:
                    did, fields = payload
                    bid = did.encode()
                    if txn.get(bid, db=self._ids) is None:
                        res.orphan_outcomes += 1
                        continue
                    old_out = txn.get(bid, db=self._out)
                    merged = merge_outcome(orjson.loads(old_out) if old_out else None, fields)
                    txn.put(bid, orjson.dumps(merged, default=str), db=self._out)
                    res.outcomes += 1
        return res

    def used_bytes(self, txn: lmdb.Transaction | None = None) -> int:
        """Bytes of live pages (not the file size: LMDB reuses freed pages, never shrinks)."""
        if txn is None:
            with self.env.begin() as t:
                return self.used_bytes(t)
        total = 0
        for db in (self._rec, self._ids, self._out):
            s = txn.stat(db)
            total += (s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"]) * s["psize"]
        return total

    def prune(self, now_ns: int | None = None, *, fraction: float = 0.0) -> int:
        """Apply retention: delete records older than ``max_age_s``, then the oldest until
        live data is under 90% of ``max_bytes``; ``fraction`` > 0 also drops that share of
        the oldest records (used when the map is full). Returns records deleted."""
        now_ns = time.time_ns() if now_ns is None else now_ns
        deleted = 0
        with self.env.begin(write=True) as txn:
            n = txn.stat(self._rec)["entries"]
            if fraction > 0:
                deleted += self._delete_oldest(txn, max(1, int(n * fraction)))
            if self.max_age_s is not None:
                cutoff = _KEY.pack(max(0, now_ns - int(self.max_age_s * 1e9)))
                deleted += self._delete_oldest(txn, n, before=cutoff)
            if self.used_bytes(txn) > self.max_bytes:
                target = int(self.max_bytes * 0.9)
                while self.used_bytes(txn) > target:
                    n = self._delete_oldest(txn, 256)
                    if not n:
                        break
                    deleted += n
        return deleted

    def _delete_oldest(self, txn: lmdb.Transaction, limit: int,
                       before: bytes | None = None) -> int:
        cur = txn.cursor(db=self._rec)
        n = 0
        if not cur.first():
            return 0
        while n < limit:
            key = cur.key()
            if before is not None and key >= before:
                break
            rid = orjson.loads(cur.value())["id"].encode()
            if txn.get(rid, db=self._ids) == key:
                txn.delete(rid, db=self._ids)
                txn.delete(rid, db=self._out)
            n += 1
            if not cur.delete():  # deletes and moves to the next entry
                break
            if cur.key() == b"":
                break
        return n

    # -- reading (any thread) -------------------------------------------------------------
    def get(self, decision_id: str) -> dict[str, Any] | None:
        """The record with its outcome joined, or None."""
        bid = decision_id.encode()
        with self.env.begin() as txn:
            key = txn.get(bid, db=self._ids)
            if key is None:
                return None
            raw = txn.get(key, db=self._rec)
            out = txn.get(bid, db=self._out)
        if raw is None:
            return None
        return _load(raw, out)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self.records()

    def records(self, chunk: int = 1000) -> Iterator[dict[str, Any]]:
        """Every record in arrival order, outcome joined. Reads in chunks, each in its own
        short transaction, so a long iteration never pins pages the writer wants back."""
        after: bytes | None = None
        while True:
            batch: list[tuple[bytes, bytes | None]] = []
            with self.env.begin() as txn:
                cur = txn.cursor(db=self._rec)
                ok = cur.set_range(after) if after is not None else cur.first()
                if ok and after is not None and cur.key() == after:
                    ok = cur.next()
                while ok and len(batch) < chunk:
                    after = cur.key()
                    raw = cur.value()
                    rid = orjson.loads(raw)["id"].encode()
                    batch.append((raw, txn.get(rid, db=self._out)))
                    ok = cur.next()
            for raw, out in batch:
                yield _load(raw, out)
            if len(batch) < chunk:
                return

    def last_id(self) -> str | None:
        with self.env.begin() as txn:
            cur = txn.cursor(db=self._rec)
            return orjson.loads(cur.value())["id"] if cur.last() else None

    def __len__(self) -> int:
        with self.env.begin() as txn:
            return txn.stat(self._rec)["entries"]

    def outcome_count(self) -> int:
        with self.env.begin() as txn:
            return txn.stat(self._out)["entries"]

    def close(self) -> None:
        self.env.close()


def _load(raw: bytes, out: bytes | None) -> dict[str, Any]:
    rec = orjson.loads(raw)
    check_record(rec)
    return join(rec, orjson.loads(out) if out else None)


# Logs this process has open for writing: LMDB forbids opening one environment twice in a
# process, so readers in the same process (the gateway's admin API) share the writer's.
_OPEN: dict[str, Store] = {}


def open_log(path: str | os.PathLike[str]) -> Store:
    """A log for reading: the writer's own store if this process records to it."""
    store = _OPEN.get(os.path.realpath(path))
    return store if store is not None else Store(path, readonly=True)


def register_open(store: Store) -> None:
    _OPEN[os.path.realpath(store.path)] = store


def unregister_open(store: Store) -> None:
    _OPEN.pop(os.path.realpath(store.path), None)
