"""The directory's exact mode: per worker, an event set from the engine's KV events, and a
mode that says which set a match reads (exact: events alone; degraded: events ∪ learned;
approximate: learned alone)."""

from hypothesis import example, given, settings
from hypothesis import strategies as st

from cachepilot.core.directory import APPROXIMATE, DEGRADED, EXACT, PrefixDirectory

A = [11, 12, 13, 14]
B = [21, 22, 23]


def two_workers() -> PrefixDirectory:
    d = PrefixDirectory(100)
    d.add_worker("w0")
    d.add_worker("w1")
    return d


def test_modes_read_their_sets() -> None:
    d = two_workers()
    d.insert("w0", A)  # routing sent A to w0 ...
    d.stored("w0", A[:2])  # ... but the engine says it holds only two blocks of it
    d.stored("w1", B)  # and w1 holds B, which routing never sent there
    assert d.mode("w0") == APPROXIMATE
    assert d.match(A, ["w0"]) == {"w0": 4}  # approximate: what routing learned
    assert d.match(B, ["w1"]) == {"w1": 0}
    d.set_mode("w0", EXACT)
    assert d.match(A, ["w0"]) == {"w0": 2}  # exact: the engine's word only
    d.stored("w0", A[:2])
    d.set_mode("w0", DEGRADED)
    assert d.match(A, ["w0"]) == {"w0": 4}  # degraded: events ∪ learned
    d.set_mode("w1", EXACT)
    d.stored("w1", B)
    assert d.match(B, ["w0", "w1"]) == {"w0": 0, "w1": 3}


def test_falling_back_to_approximate_drops_the_stale_event_set() -> None:
    d = two_workers()
    d.set_mode("w0", EXACT)
    d.stored("w0", B)
    d.set_mode("w0", APPROXIMATE)
    assert d.event_blocks("w0") == frozenset()
    d.set_mode("w0", EXACT)
    assert d.match(B, ["w0"]) == {"w0": 0}  # not resurrected


def test_removal_prunes_both_sets_and_clear_empties_them() -> None:
    d = two_workers()
    d.set_mode("w0", DEGRADED)
    d.insert("w0", A)
    d.stored("w0", A)
    d.removed("w0", [A[2]])
    assert d.match(A, ["w0"]) == {"w0": 2}  # gone from events and from the learned set
    d.set_mode("w0", APPROXIMATE)
    assert d.match(A, ["w0"]) == {"w0": 2}
    d.cleared("w0")
    assert d.match(A, ["w0"]) == {"w0": 0}
    assert d.stats()["w0"]["blocks"] == 0


def test_workers_never_see_each_others_events_and_removal_forgets_all() -> None:
    d = two_workers()
    for w in ("w0", "w1"):
        d.set_mode(w, EXACT)
    d.stored("w0", A)
    d.removed("w1", A)  # another worker's removal
    assert d.match(A, ["w0", "w1"]) == {"w0": 4, "w1": 0}
    d.remove_worker("w0")
    assert d.distinct_blocks() == 0
    d.add_worker("w2")  # reuses w0's bit
    d.set_mode("w2", EXACT)
    assert d.match(A, ["w2"]) == {"w2": 0}
    assert d.modes()["w2"] == {"mode": EXACT, "event_blocks": 0, "pending_blocks": 0}


ops = st.lists(st.tuples(st.sampled_from(["w0", "w1"]),
                         st.sampled_from(["stored", "removed", "cleared", "insert", "mode",
                                          "age", "prefilled"]),
                         st.lists(st.integers(1, 8), max_size=5),
                         st.sampled_from([EXACT, DEGRADED, APPROXIMATE])), max_size=40)


@settings(max_examples=200)
@given(ops)
@example([("w1", "mode", [], EXACT), ("w1", "insert", [1], EXACT),
          ("w1", "removed", [1], EXACT)])  # a late removal of a block routed this generation
@example([("w1", "mode", [], EXACT), ("w1", "stored", [1], EXACT),
          ("w1", "insert", [1], EXACT), ("w1", "prefilled", [1], EXACT),
          ("w1", "removed", [1], EXACT)])  # ... by a request already prefilled: believed
def test_match_agrees_with_a_reference_model(seq) -> None:
    d = two_workers()
    events = {"w0": set(), "w1": set()}
    learned = {"w0": set(), "w1": set()}
    pending = {"w0": {}, "w1": {}}  # hash -> generation
    gen = {"w0": 0, "w1": 0}
    mode = {"w0": APPROXIMATE, "w1": APPROXIMATE}
    for w, op, hs, m in seq:
        if op == "stored":
            d.stored(w, hs)
            for h in hs:
                if h not in events[w]:  # newly announced: confirmed, no longer pending
                    events[w].add(h)
                    pending[w].pop(h, None)
        elif op == "removed":
            d.removed(w, hs)
            for h in hs:
                events[w].discard(h)
                # A block routed here in the current generation is being computed again: a
                # removal (announced a step late) is of the copy before it, so it stays.
                if pending[w].get(h) == gen[w]:
                    continue
                learned[w].discard(h)
                pending[w].pop(h, None)
        elif op == "cleared":
            d.cleared(w)
            events[w].clear()
            learned[w].clear()
            pending[w].clear()
        elif op == "insert":
            d.insert(w, hs)  # capacity 100: never evicts here
            learned[w] |= set(hs)
            if mode[w] != APPROXIMATE:  # announced blocks too: see "removed"
                pending[w].update((h, gen[w]) for h in hs)
        elif op == "prefilled":
            d.prefilled(w, hs)
            for h in hs:
                if h in events[w]:  # announced, and its request is done: no longer pending
                    pending[w].pop(h, None)
        elif op == "age":
            d.age_pending(w)
            gen[w] += 1
            pending[w] = {h: g for h, g in pending[w].items() if g > gen[w] - 2}
        else:
            d.set_mode(w, m)
            mode[w] = m
            if m == APPROXIMATE:
                events[w].clear()
                pending[w].clear()
    for probe in ([1, 2, 3, 4], [5, 6, 7, 8], [2, 1], [8, 7, 6]):
        got = d.match(probe, ["w0", "w1"])
        for w in ("w0", "w1"):
            announced = events[w] | set(pending[w])
            held = {EXACT: announced, APPROXIMATE: learned[w],
                    DEGRADED: announced | learned[w]}[mode[w]]
            n = 0
            while n < len(probe) and probe[n] in held:
                n += 1
            assert got[w] == n, (w, mode[w], probe)


def test_routed_blocks_count_until_announced_or_aged_out() -> None:
    d = two_workers()
    d.set_mode("w0", EXACT)
    d.insert("w0", A)  # routed: its prefill is running, nothing announced yet
    assert d.match(A, ["w0", "w1"]) == {"w0": 4, "w1": 0}
    d.stored("w0", A[:2])  # the engine announced two blocks ...
    d.age_pending("w0")
    d.age_pending("w0")  # ... and never the other two: they age out
    assert d.match(A, ["w0"]) == {"w0": 2}
    assert d.modes()["w0"] == {"mode": EXACT, "event_blocks": 2, "pending_blocks": 0}


def test_a_late_removal_keeps_a_block_just_routed_there_until_it_ages_out() -> None:
    # vLLM announces a step's evictions after the step: a removal that arrives after we
    # routed a request for the block is of the old copy; that request computes it again.
    d = two_workers()
    d.set_mode("w0", EXACT)
    d.stored("w0", A)
    d.insert("w0", A)  # routed again
    d.removed("w0", A)
    assert d.match(A, ["w0"]) == {"w0": 4}
    d.age_pending("w0")
    d.age_pending("w0")  # never announced again: gone
    assert d.match(A, ["w0"]) == {"w0": 0}
    # A removal of a block not routed this generation is believed at once.
    d.stored("w0", A)
    d.age_pending("w0")
    d.removed("w0", A)
    assert d.match(A, ["w0"]) == {"w0": 0}


def test_a_removal_after_the_routed_request_was_prefilled_is_believed() -> None:
    # The chat study on vLLM (docs/vllm.md): a request routed for an announced prefix hit it
    # (nothing new to announce) and finished; seconds later, in the same generation, the
    # engine evicted the prefix. That removal is real: the next request must not be told
    # it hits (it was, for up to two generations, before prefilled()).
    d = two_workers()
    d.set_mode("w0", EXACT)
    d.stored("w0", A)
    d.insert("w0", A)  # routed: the engine will reuse A
    d.stored("w0", A[2:])  # (announced again: nothing changes)
    d.prefilled("w0", A)  # its first token: done with A
    assert d.match(A, ["w0"]) == {"w0": 4}  # still held, as announced
    assert d.modes()["w0"]["pending_blocks"] == 0
    d.removed("w0", A[1:])
    assert d.match(A, ["w0"]) == {"w0": 1}
    # A block routed and not announced yet stays pending though its request is done (its
    # store may come a moment after the first token): aged out if it never does.
    d.insert("w0", B)
    d.prefilled("w0", B)
    assert d.match(B, ["w0"]) == {"w0": 3}


def test_the_router_settles_a_requests_blocks_at_its_first_token() -> None:
    """Through the router: a request that reused an announced prefix stops protecting it at
    its first token, so a removal announced afterwards (same generation) is believed by the
    next decision; before its first token the removal is taken for the old copy's."""
    from cachepilot.core.cost import Weights
    from cachepilot.core.fingerprint import BlockConfig
    from cachepilot.core.request import InferenceRequest
    from cachepilot.core.router import static_router
    from cachepilot.core.workers import WorkerMetrics

    w = "w:1"
    for first_token, expected in ((True, 0), (False, 3)):
        router = static_router([w], policy="round_robin", weights=Weights(), models=(),
                               block=BlockConfig(4), capacity_blocks=100, engine="vllm")
        pool = router.pools["default"]
        pool.update_metrics(w, WorkerMetrics(scraped_at=0.0))
        d = pool.directory
        d.set_mode(w, EXACT)
        req = InferenceRequest(model="m", token_ids=tuple(range(13)))
        hashes = router.fingerprint(req, pool).hashes
        d.stored(w, hashes)
        decision = router.route(req, now=1.0)
        assert decision.winner.matched_blocks == 3
        if first_token:
            router.first_token(decision)
        d.removed(w, hashes)
        assert router.route(req, now=2.0).winner.matched_blocks == expected
