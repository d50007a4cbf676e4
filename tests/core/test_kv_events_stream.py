"""The pure event-stream state machine (core/kv_events.py): order, gaps, late joins,
replays, holes, restarts, silence, and which KV groups count."""

from cachepilot.core.directory import APPROXIMATE, DEGRADED, EXACT, PrefixDirectory
from cachepilot.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventStream


def stream(**kw) -> tuple[PrefixDirectory, EventStream]:
    d = PrefixDirectory(1000)
    d.add_worker("w")
    return d, EventStream(d, "w", **kw)


def st(*hs: int, **kw) -> BlockStored:
    return BlockStored(tuple(hs), **kw)


def held(d: PrefixDirectory) -> set[int]:
    return set(d.event_blocks("w"))


def test_in_order_from_zero_is_exact() -> None:
    d, s = stream()
    assert s.mode == APPROXIMATE
    s.on_live(0, [st(1, 2, 3)], now=0)
    s.on_live(1, [BlockRemoved((3,))], now=0)
    assert s.mode == EXACT and held(d) == {1, 2}
    assert d.match([1, 2, 3], ["w"]) == {"w": 2}


def test_gap_is_filled_by_replay_then_applied_in_order() -> None:
    d, s = stream()
    s.on_live(0, [st(1)], now=0)
    s.on_live(3, [BlockRemoved((2,))], now=0.1)  # 1 and 2 lost
    assert s.counters.gaps == 1 and s.replay_wanted(0.1) == 1
    assert s.replay_wanted(0.2) is None  # in flight
    s.on_replay([(1, [st(2)]), (2, [st(4)]), (3, [BlockRemoved((2,))])], ended=True, now=0.3)
    assert s.mode == EXACT and held(d) == {1, 4} and s.next_seq == 4
    assert s.counters.holes == 0 and s.counters.replayed_batches == 3


def test_late_join_replays_from_zero() -> None:
    d, s = stream()
    assert s.replay_wanted(0) == 0  # first contact: ask for the whole history
    s.on_replay([(0, [st(1)]), (1, [st(2)])], ended=True, now=0.1)
    assert s.mode == EXACT and held(d) == {1, 2}
    d2, s2 = stream()
    s2.on_live(5, [st(9)], now=0)  # live traffic first
    assert s2.counters.late_joins == 1 and s2.replay_wanted(0) == 0
    s2.on_replay([*((k, [st(k)]) for k in range(5)), (5, [st(9)])], ended=True, now=0.1)
    assert s2.mode == EXACT and held(d2) == {0, 1, 2, 3, 4, 9}


def test_idle_fresh_publisher_answers_nothing_and_that_is_exact() -> None:
    _d, s = stream()
    assert s.replay_wanted(0) == 0
    s.on_replay([], ended=True, now=0.1)
    assert s.mode == EXACT and s.next_seq == 0


def test_hole_after_a_gap_drops_the_stale_set_and_degrades() -> None:
    d, s = stream()
    d.insert("w", [1, 7])  # routing-learned
    s.on_live(0, [st(1, 2)], now=0)
    s.on_live(10, [st(7)], now=0)
    assert s.replay_wanted(0) == 1
    s.on_replay([(8, [st(5)]), (9, [st(6)])], ended=True, now=0.1)  # 1..7 are gone
    assert s.counters.holes == 1 and s.mode == DEGRADED
    assert held(d) == {5, 6, 7}  # blocks 1, 2 were maybe evicted in the hole: dropped
    assert d.match([1, 7], ["w"]) == {"w": 2}  # degraded: events ∪ learned
    s.on_live(11, [AllBlocksCleared()], now=0.2)  # the engine's truth is known again
    assert s.mode == EXACT and d.match([1, 7], ["w"]) == {"w": 0}


def test_replay_timeout_is_a_hole_too() -> None:
    d, s = stream(replay_timeout=1.0)
    s.on_live(0, [st(1)], now=0)
    s.on_live(2, [st(3)], now=0)
    assert s.replay_wanted(0) == 1
    assert s.replay_wanted(0.5) is None
    s.replay_wanted(1.5)  # the first timed out: hole, apply what is held
    assert s.counters.holes == 1 and s.mode == DEGRADED and held(d) == {3}


def test_no_replay_endpoint_degrades_at_once_on_a_gap() -> None:
    d, s = stream(can_replay=False)
    s.on_live(0, [st(1)], now=0)
    s.on_live(2, [st(3)], now=0)
    assert s.replay_wanted(0) is None and s.mode == DEGRADED and held(d) == {3}


def test_publisher_restart_clears() -> None:
    d, s = stream()
    d.insert("w", [1])
    s.on_live(0, [st(1)], now=0)
    s.on_live(1, [st(2)], now=0)
    s.on_live(0, [st(9)], now=5)  # numbers went back: a new engine, an empty cache
    assert s.counters.restarts == 1 and s.mode == EXACT and held(d) == {9}
    assert d.stats()["w"]["blocks"] == 0  # the learned set was cleared too


def test_silence_with_no_answer_falls_back_then_rejoins() -> None:
    d, s = stream(heartbeat_every=1.0, replay_timeout=0.5, stale_after=3.0)
    s.on_live(0, [st(1)], now=0)
    assert s.replay_wanted(0.5) is None
    assert s.replay_wanted(1.0) == 1  # heartbeat
    s.on_replay([], ended=True, now=1.1)  # idle publisher answers: still exact
    s.on_silence_check(3.0)
    assert s.mode == EXACT
    s.replay_wanted(2.2)  # heartbeat, never answered
    s.on_silence_check(4.2)
    assert s.mode == APPROXIMATE and s.counters.stale == 1 and held(d) == set()
    assert s.replay_wanted(4.3) in (None, 0)
    s.replay_wanted(5.0)
    s.on_replay([(0, [st(1)]), (1, [st(2)])], ended=True, now=5.1)  # answers again
    assert s.mode == EXACT and held(d) == {1, 2}


def test_only_full_attention_device_blocks_count() -> None:
    d, s = stream()
    s.on_live(0, [st(1, group=0, kind="full_attention"),
                  st(2, group=1, kind="sliding_window"),
                  st(3, medium="CPU"), st(4)], now=0)
    s.on_live(1, [BlockRemoved((2,), group=1), BlockRemoved((1,), group=1)], now=0)
    assert held(d) == {1, 4}  # group 1 is sliding-window: its removals say nothing of 1
    s.on_live(2, [BlockRemoved((1,), group=0)], now=0)
    assert held(d) == {4} and s.counters.ignored_events == 4


def test_pending_is_bounded() -> None:
    d, s = stream(max_pending=3)
    s.on_live(0, [], now=0)
    for k in range(2, 10):
        s.on_live(k, [st(k)], now=0)
    assert len(s.pending) == 3 and s.counters.dropped_pending == 5
    s.replay_wanted(0)
    s.on_replay([(k, [st(k)]) for k in range(1, 10)], ended=True, now=0.1)
    assert s.mode == EXACT and held(d) == set(range(1, 10))
