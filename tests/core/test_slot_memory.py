"""llama-server's host-memory prompt cache as the directory and the simulated slot engine
model it (cachepilot.core.slot_memory): a prompt that leaves its slot is saved and restored
on a later match, the oldest saved goes first when the cache is full, a restore needs the
request to keep a quarter of the cached prompt, and the eviction price charges only for
what is really lost."""

from __future__ import annotations

from dataclasses import replace

import orjson

from cachepilot.core.directory import PrefixDirectory
from cachepilot.core.request import CHAT_PATH, COMPLETIONS_PATH, parse_openai_body
from cachepilot.core.slot_memory import SlotConfig, SlotMemory
from cachepilot.sim.engine import EngineConfig, EngineRequest
from cachepilot.sim.slot_engine import SlotEngine

from helpers.routers import make_router


def parse_request(path: str, body: dict) -> object:
    return parse_openai_body(path, orjson.dumps(body))


def doc(k: int, n: int = 30) -> list[int]:
    """A document's chain: ``n`` blocks nothing else shares."""
    return [k * 1000 + i for i in range(n)]


A, B, C, D = doc(1), doc(2), doc(3), doc(4)


def cached_dir(entries: int, *workers: str) -> PrefixDirectory:
    d = PrefixDirectory()
    for w in workers:
        d.add_worker(w)
        d.set_slots(w, slots=1, slot_blocks=64, entries=entries)
    return d


def test_a_prompt_that_left_the_slot_is_restored_from_the_cache() -> None:
    """The issue's probe (A, B, C, then A on one slot) as the directory sees it."""
    d = cached_dir(280, "w")
    for chain in (A, B, C):
        d.insert("w", [*chain, 7])
    assert d.match([*A, 8], ["w"]) == {"w": 30}
    assert d.match([*B, 8], ["w"]) == {"w": 30}
    assert d.stats()["w"]["evictions"] == 0
    # Without the cache (--cache-ram 0) only the slot's prompt is held.
    d0 = cached_dir(0, "w")
    for chain in (A, B, C):
        d0.insert("w", [*chain, 7])
    assert d0.match([*A, 8], ["w"]) == {"w": 0}
    assert d0.match([*C, 8], ["w"]) == {"w": 30}


def test_the_oldest_saved_prompt_goes_first_and_a_restore_moves_it() -> None:
    m = SlotMemory(SlotConfig(slots=1, slot_blocks=64, entries=2))
    for chain in (A, B, C):
        m.place(chain)
    assert m.cache == [tuple(A), tuple(B)]
    m.place(D)  # saves C: A, the oldest, is dropped
    assert m.cache == [tuple(B), tuple(C)]
    assert m.reuse(A) == 0
    # The engine saves the slot's prompt before it looks for one to restore: saving D
    # drops B, the oldest, which this request wanted.
    assert m.reuse([*B, 5]) == 0
    m = SlotMemory(SlotConfig(slots=1, slot_blocks=64, entries=3))
    for chain in (A, B, C):
        m.place(chain)
    placed = m.place([*B, 5])  # saves C, restores B: it leaves the cache for the slot
    assert placed.reused == 30
    assert m.cache == [tuple(A), tuple(C)]
    assert m.slots == [(*B, 5)]


def test_a_cached_prompt_is_restored_only_for_a_quarter_of_itself() -> None:
    """"Don't trash large prompts": a request sharing a short head of a cached prompt
    (a system prompt) reuses nothing, though every block of that head is held."""
    m = SlotMemory(SlotConfig(slots=1, slot_blocks=64, entries=10))
    m.place(A)
    m.place(B)  # A is saved
    head = A[:6]  # 6 of A's 30 blocks: 20 %
    assert m.reuse([*head, 99, 98]) == 0
    assert m.reuse([*A[:10], 99]) == 10  # a third of A: restored


def test_a_similar_request_keeps_its_slot_and_saves_nothing() -> None:
    m = SlotMemory(SlotConfig(slots=1, slot_blocks=64, entries=10))
    m.place([*A, 1])
    placed = m.place([*A, 2])  # most of the slot is kept: no cache update
    assert placed.reused == 30 and m.cache == []


def test_sliding_window_models_reuse_up_to_a_context_checkpoint() -> None:
    """Gemma 3 on llama-server (measured: docs/real-model.md): a match is reused only up to
    a checkpoint made while the held prompt was processed, at the start of its batch that
    begins one -ub before its end; without one, nothing."""
    m = SlotMemory(SlotConfig(slots=1, slot_blocks=64, min_reuse=32, batch=16,
                              checkpoint_offsets=(16, 0)))
    m.place(A)  # 30 blocks, fed as [0, 14) and [14, 30): a checkpoint at 14
    assert m.reuse([*A, 5]) == 14
    assert m.reuse(A[:10]) == 0  # shorter than any checkpoint
    m.place(doc(5, 12))  # one batch from 0: no checkpoint
    assert m.reuse([*doc(5, 12), 1]) == 0


def test_a_long_match_in_the_slot_is_reused_whole_but_not_once_restored() -> None:
    """Measured on llama-server: a match past the window is reused whole while the held
    prompt's window cache is all there (processed in the slot), and only up to a
    checkpoint once the prompt has been through the prompt cache."""
    cfg = SlotConfig(slots=1, slot_blocks=64, entries=10, min_reuse=32, batch=16,
                     checkpoint_offsets=(16, 0))
    long = doc(6, 38)  # fed as [0, 22) and [22, 38): a checkpoint at 22
    m = SlotMemory(cfg)
    m.place(long)
    assert m.reuse([*long[:36], 1, 2]) == 36  # 36 > the 32-block window: whole
    assert m.reuse([*long[:20], 1]) == 0  # inside the window: no checkpoint below 20
    m.place(B)  # long goes to the prompt cache
    assert m.reuse([*long[:36], 1, 2]) == 22  # restored: from the checkpoint only


def test_a_chat_prompt_is_reused_up_to_its_last_message_in_the_slot_or_restored() -> None:
    """Measured on llama-server (chat, a document in the system message, the question in
    the user's): the document was reused whole the next time, in the slot or restored from
    the prompt cache, where a completion of the same text reused only up to a batch
    checkpoint. A match that ends inside the last message still gets a batch checkpoint."""
    cfg = SlotConfig(slots=1, slot_blocks=64, entries=10, min_reuse=32, batch=16,
                     checkpoint_offsets=(16, 0))
    shared = doc(6, 27)  # the system message: 27 blocks, then the question
    first = [*shared, 1, 2, 3]  # fed as [0, 14), [14, 30): a batch checkpoint at 14
    again = [*shared, 7, 8, 9]  # the same document, another question
    for turn, expected in ((0, 14), (27, 27)):
        m = SlotMemory(cfg)
        m.place(first, turn=turn)
        assert m.reuse(again) == expected  # in the slot
        m.place(B)
        assert m.reuse(again) == expected  # restored from the prompt cache
    m = SlotMemory(cfg)
    m.place(first, turn=20)  # a shorter shared part (the match ends past it)...
    assert m.reuse([*first[:24], 5]) == 20  # ...reuses up to the last message only
    assert m.reuse([*first[:18], 5]) == 14  # a match inside it: the batch checkpoint


def test_the_directory_checkpoints_a_chat_request_where_its_last_message_starts() -> None:
    """The router tells the directory where a chat request's last message starts (byte
    blocks before it), so a slot worker's next request for the same history counts as a
    whole hit; a completion of the same text gets only the batch checkpoint."""
    router = make_router(workers=("10.0.0.1:8000",))
    pool = router.pools["default"]
    pool.directory.set_slots("10.0.0.1:8000", slots=1, slot_blocks=512, entries=10,
                             min_reuse=32, batch=16)
    system = "a shared document for the assistant to read. " * 40  # ~1.8 KB, > 16 blocks
    chat = parse_request(CHAT_PATH, {"model": "m", "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "question one?"}]})
    assert chat.prompt[chat.last_message_at:].startswith("<|user|>")
    d = router.route(chat, 100.0)
    router.release(d)
    again = parse_request(CHAT_PATH, {"model": "m", "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "another one?"}]})
    block_bytes = pool.spec.block.block_bytes
    turn = len(again.prompt[:again.last_message_at].encode()) // block_bytes
    assert router.decide(pool, "m", router.prepare(again)[1], 101.0, "x").winner.matched_blocks \
        == turn
    text = parse_request(COMPLETIONS_PATH, {"model": "m", "prompt": chat.prompt})
    assert text.last_message_at == 0
    other = make_router(workers=("10.0.0.1:8000",))
    other.pools["default"].directory.set_slots("10.0.0.1:8000", slots=1, slot_blocks=512,
                                               entries=10, min_reuse=32, batch=16)
    other.release(other.route(text, 100.0))
    fp = other.prepare(again)[1]
    assert other.decide(other.pools["default"], "m", fp, 101.0, "y").winner.matched_blocks \
        < turn


def test_evicting_is_priced_only_when_the_cache_really_drops_a_prompt() -> None:
    d = cached_dir(2, "a", "b")
    for q in range(4):  # A is asked about four times on a
        d.insert("a", [*A, 100 + q])
    d.insert("a", B)  # A is saved
    assert d.eviction_blocks("a", C) == 0.0  # saving B fits: A stays
    d.insert("a", C)  # the cache: A, B
    assert d.eviction_blocks("a", D) > 20  # saving C drops A, the oldest: A is lost
    d.insert("b", [*A, 200])
    assert d.eviction_blocks("a", D) < 1.0  # b has A too: nothing becomes homeless


def test_the_slot_engine_restores_from_its_prompt_cache() -> None:
    cfg = replace(EngineConfig(), slots=1, num_blocks=64, prompt_cache=8)
    t = 0.0

    def serve(e: SlotEngine, rid: int, chain: list[int]) -> int:
        nonlocal t
        req = EngineRequest(rid, len(chain) * 16, tuple(chain), 2, t)
        e.submit(req)
        while req.finished_at is None:
            t = e.step(t).end
        return req.cached_tokens

    e = SlotEngine(cfg)
    for i, chain in enumerate((A, B, C)):
        assert serve(e, i, [*chain, 5]) == 0
    assert serve(e, 9, [*A, 6]) == 30 * 16
    e0 = SlotEngine(replace(cfg, prompt_cache=0))
    for i, chain in enumerate((A, B, [*A, 6])):
        assert serve(e0, i, chain) == 0
