"""The tree of chains keeps exactly the order an OrderedDict of blocks kept (each insert
moves its chain to the newest end, leaf first), at a cost per branch instead of per block."""

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from cachepilot.core.chain_lru import ChainLRU
from cachepilot.core.fingerprint import chain_hashes

# Prompts that share prefixes the way real traffic does: a tree of documents and tails.
TRUNKS = [chain_hashes(bytes([t]) * 8 * 40, 8) for t in range(3)]


def prompt(trunk: int, cut: int, tail: int, length: int) -> list[int]:
    head = TRUNKS[trunk][:cut]
    return head + chain_hashes(bytes([100 + tail]) * 8 * length, 8, head[-1] if head else trunk)


ops = st.lists(st.one_of(
    st.tuples(st.just("touch"), st.integers(0, 2), st.integers(0, 40), st.integers(0, 3),
              st.integers(0, 12)),
    st.tuples(st.just("evict"), st.integers(1, 30)),
    st.tuples(st.just("discard"), st.integers(0, 2), st.integers(0, 39))), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_same_order_added_and_evicted_as_an_ordered_dict(seq) -> None:
    lru, ref = ChainLRU(), OrderedDict()
    for op in seq:
        if op[0] == "touch":
            chain = prompt(*op[1:])
            added = lru.touch(chain)
            expect = [h for h in chain if h not in ref]
            for h in reversed(chain):
                ref.pop(h, None)
                ref[h] = None
            assert sorted(added) == sorted(expect)
        elif op[0] == "evict":
            n = min(op[1], len(ref))
            expect = [ref.popitem(last=False)[0] for _ in range(n)]
            assert lru.evict(n) == expect
        else:
            h = TRUNKS[op[1]][op[2]]
            assert lru.discard(h) == (h in ref)
            ref.pop(h, None)
        assert len(lru) == len(ref) and list(lru) == list(ref)
        assert all(h in lru for h in ref)


def test_touching_a_held_prompt_adds_nothing_and_costs_per_branch() -> None:
    lru = ChainLRU()
    doc = chain_hashes(b"d" * 64 * 3500, 64)
    assert len(lru.touch(doc)) == 3500
    for i in range(5):
        tail = chain_hashes(bytes([i]) * 64 * 4, 64, doc[-1])
        assert len(lru.touch(doc + tail)) == 4
    assert lru.touch(doc) == [] and len(lru) == 3520
    assert lru.most_recent(2) == doc[:2]  # the root is the newest
