"""The prefix directory's lookup (:meth:`cachepilot.core.directory.PrefixDirectory.match`):
the longest cached prefix of a prompt's block hashes for each of several workers, read from
the directory's hash → worker-bitmask maps, each worker through its mode (the event set, the
routing-learned set, or both), one dict lookup and one AND per block whatever the number of
workers.

Workers whose routing-learned set is prefix-closed (:attr:`WorkerBlocks.closed`) and read
through it alone are found by bisection when the hashes are chained
(:func:`closed_depths`); the others by a scan that stops where the last of them stops
matching (:func:`scan`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from cachepilot.core.worker_blocks import APPROXIMATE, EXACT, WorkerBlocks


def match_blocks(hashes: Sequence[int], all_workers: Mapping[str, WorkerBlocks],
                 workers: Iterable[str], chained: bool, learned_only: bool,
                 masks: dict[int, int], event_masks: dict[int, int]) -> dict[str, int]:
    """Longest matched prefix, in blocks, of each of ``workers`` known in ``all_workers``
    (see :meth:`~cachepilot.core.directory.PrefixDirectory.match`); ``masks`` is the
    routing-learned index, ``event_masks`` the events'.

    ``chained``: every list the directory was given and ``hashes`` are chained block hashes
    (a block's hash names its whole prefix, as fingerprints do), so a worker read through
    its routing-learned set alone, that set being *prefix-closed*
    (:attr:`WorkerBlocks.closed`: holding a block means holding every block before it), is
    found by bisection, a few dozen lookups whatever the prompt's length
    (:func:`closed_depths`). The others, and every worker without ``chained``, by a scan
    that stops where the last of them stops matching (:func:`scan`). ``learned_only``: read
    the routing-learned set whatever the mode."""
    wanted = {w: all_workers[w] for w in workers if w in all_workers}
    result = dict.fromkeys(wanted, 0)
    if not hashes:
        return result
    closed = learned = exact = 0  # bits read by bisection / the scan's two maps
    for wb in wanted.values():
        if chained and wb.closed and (wb.mode == APPROXIMATE or learned_only):
            closed |= wb.bit
            continue
        if wb.mode != EXACT or learned_only:
            learned |= wb.bit
        if wb.mode != APPROXIMATE and not learned_only:
            exact |= wb.bit
    found = (closed_depths(hashes, closed, masks) if closed else []) + (
        scan(hashes, learned, exact, masks, event_masks) if learned | exact else [])
    for depth, bits in found:
        for w, wb in wanted.items():
            if bits & wb.bit:
                result[w] = depth
    return result


def scan(hashes: Sequence[int], learned: int, exact: int, masks: dict[int, int],
         event_masks: dict[int, int]) -> list[tuple[int, int]]:
    """Block by block: (depth, the bits that stop matching there), the bits that match
    every block last, at ``len(hashes)``. ``learned`` bits are read in ``masks``, ``exact``
    bits in ``event_masks`` (a bit in both: either)."""
    active = learned | exact
    out: list[tuple[int, int]] = []
    depth = 0
    for h in hashes:
        held = masks.get(h, 0) & learned
        if exact:
            held |= event_masks.get(h, 0) & exact
        still = active & held
        if still != active:
            out.append((depth, active & ~still))
            active = still
            if not active:
                return out
        depth += 1
    out.append((depth, active))
    return out


def closed_depths(hashes: Sequence[int], bits: int, masks: dict[int, int]
                  ) -> list[tuple[int, int]]:
    """(depth, workers) for workers of ``bits`` whose sets are prefix-closed: each holds a
    leading run of ``hashes`` and nothing after it, so the set of them holding block *i*
    only shrinks as *i* grows, and bisection between two blocks held by the same workers
    can skip everything between them. O(changes × log n) lookups."""
    get = masks.get
    n = len(hashes)
    first, last = get(hashes[0], 0) & bits, get(hashes[-1], 0) & bits
    out = [(0, bits & ~first), (n, last)]
    todo = [(0, n - 1, first, last)]
    while todo:
        lo, hi, m_lo, m_hi = todo.pop()
        if m_lo == m_hi:
            continue
        if hi - lo == 1:
            out.append((hi, m_lo & ~m_hi))  # held through block lo, not block hi
            continue
        mid = (lo + hi) // 2
        m_mid = get(hashes[mid], 0) & bits
        todo.append((lo, mid, m_lo, m_mid))
        todo.append((mid, hi, m_mid, m_hi))
    return out
