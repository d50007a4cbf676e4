from hypothesis import given, settings
from hypothesis import strategies as st

from cachepilot.core.directory import PrefixDirectory
from cachepilot.core.fingerprint import chain_hashes

WORKERS = ["w0", "w1", "w2"]


def chain(group: int, length: int) -> list[int]:
    return chain_hashes(bytes([group]) * 8 * length, 8)


ops = st.lists(st.tuples(st.sampled_from(WORKERS), st.integers(0, 4), st.integers(1, 12)),
               max_size=40)


@settings(max_examples=200)
@given(ops, st.integers(1, 20))
def test_capacity_bound_and_match_agrees_with_brute_force(seq, capacity) -> None:
    d = PrefixDirectory(capacity)
    for w in WORKERS:
        d.add_worker(w)
    held: dict[str, dict[int, None]] = {w: {} for w in WORKERS}  # reference LRU
    for w, group, length in seq:
        hs = chain(group, length)
        d.insert(w, hs)
        for h in reversed(hs):
            held[w].pop(h, None)
            held[w][h] = None
        while len(held[w]) > capacity:
            held[w].pop(next(iter(held[w])))
    for w in WORKERS:
        assert d.stats()[w]["blocks"] == len(held[w]) <= capacity
    for group in range(5):
        hs = chain(group, 12)
        got = d.match(hs, WORKERS)
        for w in WORKERS:
            expect = 0
            while expect < len(hs) and hs[expect] in held[w]:
                expect += 1
            assert got[w] == expect


def test_root_outlives_tails_under_eviction() -> None:
    d = PrefixDirectory(6)
    d.add_worker("w")
    shared = chain(1, 3)
    d.insert("w", shared + chain_hashes(b"a" * 24, 8, shared[-1]))
    d.insert("w", shared + chain_hashes(b"b" * 24, 8, shared[-1]))
    assert d.match(shared, ["w"])["w"] == 3  # tails of the first prompt were evicted first


def test_remove_worker_drops_its_entries_and_reuses_its_slot() -> None:
    d = PrefixDirectory(100)
    d.add_worker("a")
    d.add_worker("b")
    hs = chain(2, 5)
    d.insert("a", hs)
    d.insert("b", hs)
    d.remove_worker("a")
    assert d.match(hs, ["a", "b"]) == {"b": 5}
    d.add_worker("c")
    assert d.match(hs, ["c"]) == {"c": 0}  # the reused bit carries no stale entries
    d.remove_worker("b")
    assert d.distinct_blocks() == 0


def test_capacity_shrink_evicts() -> None:
    d = PrefixDirectory(100)
    d.add_worker("a")
    d.insert("a", chain(3, 50))
    d.set_capacity("a", 10)
    assert d.stats()["a"] == {"blocks": 10, "capacity": 10, "evictions": 40}


def _match_reference(d: PrefixDirectory, hashes: list[int], workers: list[str]) -> dict[str, int]:
    """The per-block scan the bisected match replaced (each worker read through its mode)."""
    out = {}
    for w in workers:
        wb = d._workers[w]
        depth = 0
        for h in hashes:
            held = (wb.mode != "exact" and bool(d._masks.get(h, 0) & wb.bit)) or (
                wb.mode != "approximate" and bool(d._event_masks.get(h, 0) & wb.bit))
            if not held:
                break
            depth += 1
        out[w] = depth
    return out


@settings(max_examples=150)
@given(st.lists(st.tuples(st.sampled_from(WORKERS), st.integers(0, 3), st.integers(1, 90),
                          st.sampled_from(["insert", "stored", "removed"])), max_size=25),
       st.lists(st.sampled_from(["exact", "degraded", "approximate"]), min_size=3,
                max_size=3))
def test_bisected_match_is_the_per_block_scan(seq, modes) -> None:
    """Chains long and short, holes from removals (the set is no longer prefix-closed),
    every mode mixed: bisection where it may, the scan elsewhere, the scan's answer."""
    d = PrefixDirectory(400)
    for w, mode in zip(WORKERS, modes, strict=True):
        d.add_worker(w)
        d.set_mode(w, mode)
    for w, group, length, op in seq:
        hs = chain(group, length)
        if op == "insert":
            d.insert(w, hs)
        elif op == "stored":
            d.stored(w, hs)
        else:
            d.removed(w, hs[length // 2:length // 2 + 1])
    for group in range(4):
        hs = chain(group, 90)
        assert d.match(hs, WORKERS) == _match_reference(d, hs, WORKERS)
        assert d.match(hs, WORKERS, chained=True) == _match_reference(d, hs, WORKERS)


@settings(max_examples=150)
@given(st.lists(st.tuples(st.sampled_from(["insert", "insert", "removed", "capacity"]),
                          st.integers(0, 2), st.integers(1, 12)), max_size=30))
def test_the_same_chain_again_keeps_the_reference_lru(seq) -> None:
    """Repeated inserts of one chain skip their moves; removals and capacity changes in
    between must not let a stale skip through (the reference LRU is the judge)."""
    d = PrefixDirectory(16)
    d.add_worker("w")
    held: dict[int, None] = {}
    cap = 16
    for op, group, length in seq:
        hs = tuple(chain(group, length))
        if op == "insert":
            d.insert("w", hs)
            for h in reversed(hs):
                held.pop(h, None)
                held[h] = None
        elif op == "removed":
            d.removed("w", hs[-1:])
            held.pop(hs[-1], None)
        else:
            cap = length + 4
            d.set_capacity("w", cap)
        while len(held) > cap:
            held.pop(next(iter(held)))
    assert list(d._workers["w"].lru) == list(held)
