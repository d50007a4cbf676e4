"""One worker's routing-learned blocks in least-recently-used order, kept as a tree of chains
so that touching a long prompt costs per branch it passes, not per block.

The directory used an OrderedDict of blocks: a prompt's insert moved every one of its blocks
to the most recent end, leaf first so the root ended newest (~50 ns a block: 0.2 ms for a
220 KB prompt, every time, even when all of it was held already). Here a prompt's chain is a
path in a radix tree whose nodes hold *runs* of consecutive blocks; a touch stamps each node
of its path (splitting the node where the chain stops or turns off), so a held prompt costs a
few slice comparisons in C. Eviction takes blocks from the end of the least recently stamped
leaf, deepest first: a parent is stamped whenever a child is, so it is never older, and the
order is exactly the OrderedDict's (oldest touch first; within one touch, the deepest block
first), which the tests hold it to.

Blocks are counted as a set of hashes, as before: a hash that sits at two places (never, for
chained hashes; possible for arbitrary lists) is held while either place is, and a removal
(:meth:`ChainLRU.discard`, an engine saying the block is gone) leaves a tombstone in the tree
that eviction skips and a later touch revives.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence


class _Node:
    __slots__ = ("base", "children", "parent", "run", "stamp")

    def __init__(self, run: list[int], parent: _Node | None, stamp: int, base: int) -> None:
        self.run = run  # the hashes of chain positions base, base + 1, …
        self.parent = parent
        self.children: dict[int, _Node] = {}  # first hash of a child's run → the child
        self.stamp = stamp  # the last touch that passed through this node
        self.base = base


class ChainLRU:
    """The blocks one worker holds, oldest first (see the module's docstring)."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._root = _Node([], None, 0, 0)
        self._heap: list[tuple[int, int, int, _Node]] = []  # (stamp, -end depth, seq, leaf)
        self._seq = 0
        self._stamp = 0
        self._count: dict[int, int] = {}  # hash → places in the tree
        self._dead: set[int] = set()  # removed hashes whose places are still in the tree

    def __len__(self) -> int:
        return len(self._count) - len(self._dead)

    def __contains__(self, h: object) -> bool:
        return h in self._count and h not in self._dead

    # -- touch ---------------------------------------------------------------------------------
    def touch(self, chain: Sequence[int]) -> list[int]:
        """``chain`` (root first) becomes the most recent; returns the hashes it adds to
        the set (new, or revived after a removal), for the caller's index."""
        self._stamp += 1
        stamp, c = self._stamp, list(chain)
        node, i, n = self._root, 0, len(c)
        added: list[int] = []
        while i < n:
            child = node.children.get(c[i])
            if child is None:
                leaf = _Node(c[i:], node, stamp, i)
                node.children[c[i]] = leaf
                added += self._count_new(leaf.run)
                node = leaf
                break
            run = child.run
            k = _common(run, c, i)
            if k < len(run):
                self._split(child, k)
            child.stamp = stamp
            node, i = child, i + k
        if self._dead:
            revived = self._dead.intersection(c)
            self._dead -= revived
            added += revived
        if node is not self._root and not node.children:
            self._push(node)
        return added

    def _count_new(self, hashes: list[int]) -> list[int]:
        count, added = self._count, []
        for h in hashes:
            n = count.get(h, 0)
            count[h] = n + 1
            if not n:
                added.append(h)
        return added

    def _split(self, node: _Node, k: int) -> None:
        """Cut ``node``'s run after ``k`` blocks: the rest becomes its only child, keeping
        the stamp and the children it had."""
        rest = _Node(node.run[k:], node, node.stamp, node.base + k)
        rest.children = node.children
        for ch in rest.children.values():
            ch.parent = rest
        node.run = node.run[:k]
        node.children = {rest.run[0]: rest}
        if not rest.children:
            self._push(rest)

    def _push(self, leaf: _Node) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (leaf.stamp, -(leaf.base + len(leaf.run)), self._seq, leaf))

    # -- evict ---------------------------------------------------------------------------------
    def evict(self, n: int) -> list[int]:
        """Take the ``n`` least recent blocks out; the hashes no longer held (for the
        caller's index)."""
        out: list[int] = []
        goal = len(self) - n
        heap = self._heap
        while len(self) > goal and heap:
            stamp, neg_end, _, leaf = heapq.heappop(heap)
            if (leaf.children or not leaf.run or leaf.stamp != stamp
                    or -neg_end != leaf.base + len(leaf.run) or leaf.parent is None):
                continue  # a stale entry: touched, split or emptied since
            key, take = leaf.run[0], min(len(leaf.run), len(self) - goal)
            for h in reversed(leaf.run[len(leaf.run) - take:]):
                out += self._forget(h)
            del leaf.run[len(leaf.run) - take:]
            if leaf.run:
                self._push(leaf)
                continue
            parent = leaf.parent
            del parent.children[key]
            leaf.parent = None
            if parent is not self._root and not parent.children:
                self._push(parent)
        return out

    def _forget(self, h: int) -> list[int]:
        n = self._count[h] - 1
        if n:
            self._count[h] = n
            return []
        del self._count[h]
        if h in self._dead:
            self._dead.discard(h)  # removed already: not held, nothing to release
            return []
        return [h]

    def discard(self, h: int) -> bool:
        """An engine removed block ``h``: no longer held (its place stays, skipped by
        eviction, revived by a touch). False if it was not held."""
        if h not in self:
            return False
        self._dead.add(h)
        return True

    # -- order ---------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[int]:
        """Held hashes, least recent first (each once, at its most recent place)."""
        places: list[tuple[int, int, int]] = []
        todo = list(self._root.children.values())
        while todo:
            node = todo.pop()
            places += [(node.stamp, -(node.base + j), h) for j, h in enumerate(node.run)]
            todo += node.children.values()
        places.sort()
        seen: dict[int, None] = {}
        for _, _, h in reversed(places):
            if h not in seen and h in self:
                seen[h] = None
        return reversed(list(seen))

    def held(self) -> set[int]:
        """The held hashes, in no order (cheaper than iterating in order)."""
        return self._count.keys() - self._dead

    def most_recent(self, k: int) -> list[int]:
        """The ``k`` most recent held hashes, newest first."""
        return list(reversed(list(self)))[:k]


def _common(run: list[int], chain: list[int], i: int) -> int:
    """How many leading blocks of ``run`` equal ``chain[i:]``: one slice comparison in C
    when all do, else bisection on slice equality."""
    n = min(len(run), len(chain) - i)
    if run[:n] == chain[i:i + n]:
        return n
    lo, hi = 0, n  # run[:lo] matches, run[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if run[lo:mid] == chain[i + lo:i + mid]:
            lo = mid
        else:
            hi = mid
    return lo
