"""The directory's slot mode: a llama.cpp worker holds one prompt per slot, replaced the way
llama-server picks a slot (most similar idle slot, else the least recently used)."""

from cachepilot.core.directory import PrefixDirectory
from cachepilot.core.fingerprint import BlockConfig
from cachepilot.core.pool import Pool, PoolSpec
from cachepilot.core.workers import WorkerMetrics

DOC_A = [1, 2, 3, 4]
DOC_B = [10, 11, 12, 13]


def test_one_slot_holds_only_the_last_prompt() -> None:
    d = PrefixDirectory()
    d.add_worker("w")
    d.set_slots("w", slots=1, slot_blocks=64)
    d.insert("w", [*DOC_A, 5])
    d.insert("w", [*DOC_B, 14])
    assert d.match(DOC_A, ["w"]) == {"w": 0}  # overwritten, however much room LRU would have
    assert d.match([*DOC_B, 14], ["w"]) == {"w": 5}
    assert d.stats()["w"] == {"blocks": 5, "capacity": 64, "evictions": 5, "slots": 1,
                              "cached_prompts": 0, "cache_entries": 0}


def test_a_similar_prompt_reuses_its_slot_and_keeps_the_other() -> None:
    d = PrefixDirectory()
    d.add_worker("w")
    d.set_slots("w", slots=2, slot_blocks=64)
    d.insert("w", [*DOC_A, 5])
    d.insert("w", [*DOC_B, 14])
    # Same document, another question: replaces DOC_A's slot (similar), not the LRU one...
    d.insert("w", [*DOC_A, 6])
    assert d.match([*DOC_A, 6], ["w"]) == {"w": 5}
    assert d.match(DOC_B, ["w"]) == {"w": 4}
    assert d.match([*DOC_A, 5], ["w"]) == {"w": 4}  # the old question's tail is gone
    # ...and the shared blocks were never dropped: only the old tail was evicted.
    assert d.stats()["w"]["evictions"] == 1
    # A dissimilar prompt takes the least recently used slot (DOC_B's).
    d.insert("w", [20, 21])
    assert d.match(DOC_B, ["w"]) == {"w": 0}
    assert d.match(DOC_A, ["w"]) == {"w": 4}


def test_prompts_are_cut_at_the_slot_context_and_workers_stay_apart() -> None:
    d = PrefixDirectory()
    d.add_worker("a")
    d.add_worker("b")
    d.set_slots("a", slots=1, slot_blocks=2)
    d.insert("a", DOC_A)
    d.insert("b", DOC_A)  # b stays a paged (LRU) worker
    assert d.match(DOC_A, ["a", "b"]) == {"a": 2, "b": 4}
    d.remove_worker("a")
    assert d.match(DOC_A, ["b"]) == {"b": 4}
    assert d.distinct_blocks() == 4


def test_switching_to_slot_mode_keeps_the_most_recent_chain() -> None:
    d = PrefixDirectory()
    d.add_worker("w")
    d.insert("w", DOC_B)
    d.insert("w", DOC_A)
    d.set_slots("w", slots=1, slot_blocks=3)
    assert d.match(DOC_A, ["w"]) == {"w": 3}
    assert d.match(DOC_B, ["w"]) == {"w": 0}
    d.set_slots("w", slots=1, slot_blocks=3)  # an unchanged report changes nothing
    assert d.match(DOC_A, ["w"]) == {"w": 3}


def test_the_pool_takes_slots_from_the_engine_metrics() -> None:
    pool = Pool(PoolSpec(block=BlockConfig(block_size=16)))
    pool.upsert_worker("w")
    pool.update_metrics("w", WorkerMetrics(slots=2, slot_tokens=1024))
    assert pool.directory.stats()["w"]["capacity"] == 2 * 1024 // 16
