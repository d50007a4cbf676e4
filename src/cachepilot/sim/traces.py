"""Request traces a user brings: Mooncake's format and CachePilot's own, told apart by their
first record.

Mooncake (kvcache-ai/Mooncake, FAST'25 trace release) writes one JSON object a line:
``timestamp`` (ms from the start), ``input_length`` and ``output_length`` (tokens) and
``hash_ids``, one id per 512-token block of the prompt, equal ids at the same position
meaning the same prefix block. It carries no text, so each 512-token block id becomes
``512 / block_size`` sub-blocks whose chained hashes derive from the id and the parent's hash:
two requests then share exactly the prefix blocks the trace says they share, at the engine's
block size. A trailing partial block is not hashed (an engine never reuses one either).

CachePilot's own trace (:func:`cachepilot.sim.workloads.write_trace`) has ``t`` (seconds) and
``segments`` or ``token_ids``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from xxhash import xxh3_64_intdigest

from cachepilot.core.fingerprint import BlockConfig, Fingerprint, model_seed

MOONCAKE_BLOCK_TOKENS = 512


class TraceFormatError(ValueError):
    """The file is not a trace in a format we read; the message says which line and why."""


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One request of a trace, in the simulator's units."""

    arrival_s: float
    fingerprint: Fingerprint
    max_tokens: int


def _rows(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed by the with below; a clear error first
    except OSError as exc:
        raise TraceFormatError(f"{path}: {exc.strerror}") from None
    with f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError:
                raise TraceFormatError(f"{path}:{n}: not a JSON object (a trace has one JSON "
                                       "object a line)") from None
            if not isinstance(row, dict):
                raise TraceFormatError(f"{path}:{n}: not a JSON object")
            yield n, row


def detect_format(path: str | Path) -> str:
    """``"mooncake"`` or ``"cachepilot"`` from the first record; TraceFormatError otherwise."""
    for n, row in _rows(path):
        if {"timestamp", "input_length", "hash_ids"} <= row.keys():
            return "mooncake"
        if "t" in row and ("segments" in row or "token_ids" in row):
            return "cachepilot"
        raise TraceFormatError(
            f"{path}:{n}: in no known trace format: expected Mooncake's timestamp, "
            "input_length, output_length, hash_ids or CachePilot's t with segments or "
            f"token_ids; found keys {sorted(row)}")
    raise TraceFormatError(f"{path}: empty trace")


def _expand(parent: int, block_id: int, sub_blocks: int, out: list[int]) -> int:
    """Append the chained hashes of one trace block's sub-blocks; return the last."""
    h = parent
    for sub in range(sub_blocks):
        h = xxh3_64_intdigest(block_id.to_bytes(8, "little", signed=True)
                              + sub.to_bytes(2, "little"), h)
        out.append(h)
    return h


def read_mooncake(path: str | Path, *, model: str, block: BlockConfig) -> list[TraceRow]:
    """Every request of a Mooncake trace, in arrival order, fingerprinted at ``block``'s
    size (which must divide 512)."""
    if MOONCAKE_BLOCK_TOKENS % block.block_size:
        raise TraceFormatError(f"block size {block.block_size} does not divide Mooncake's "
                               f"{MOONCAKE_BLOCK_TOKENS}-token blocks")
    per = MOONCAKE_BLOCK_TOKENS // block.block_size
    root = model_seed(model)
    # Many requests share long prefixes: each (parent, id) expands once.
    memo: dict[tuple[int, int], tuple[int, ...]] = {}
    rows: list[TraceRow] = []
    for n, row in _rows(path):
        try:
            ts = float(row["timestamp"])
            length = int(row["input_length"])
            out_len = int(row.get("output_length", 1))
            ids = [int(i) for i in row["hash_ids"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceFormatError(f"{path}:{n}: not a Mooncake record ({exc!r})") from None
        if length < 0 or ts < 0 or len(ids) * MOONCAKE_BLOCK_TOKENS < length:
            raise TraceFormatError(f"{path}:{n}: {len(ids)} block ids cannot hold "
                                   f"{length} input tokens")
        full = length // block.block_size
        hashes: list[int] = []
        parent = root
        for block_id in ids:
            if len(hashes) >= full:
                break
            key = (parent, block_id)
            subs = memo.get(key)
            if subs is None:
                tmp: list[int] = []
                _expand(parent, block_id, per, tmp)
                subs = memo[key] = tuple(tmp)
            hashes.extend(subs)
            parent = subs[-1]
        rows.append(TraceRow(ts / 1000.0, Fingerprint(tuple(hashes[:full]), length,
                                                      block.block_size), max(1, out_len)))
    rows.sort(key=lambda r: r.arrival_s)
    return rows
