import pytest

from cachepilot.core.fingerprint import chain_hashes
from cachepilot.sim.engine import Engine, EngineConfig, EngineRequest


def request(i: int, group: int, tokens: int = 512, out: int = 4, at: float = 0.0,
            bs: int = 16) -> EngineRequest:
    prefix = bytes([group]) * (tokens - bs) * 4
    buf = prefix + i.to_bytes(4, "little") * (bs * 4 // 4)
    return EngineRequest(i, tokens, tuple(chain_hashes(buf, bs * 4)), out, at)


def drain(e: Engine, t: float = 0.0) -> float:
    while e.has_work():
        t = e.step(t).end
    return t


def test_prefix_hit_skips_prefill() -> None:
    e = Engine(EngineConfig())
    a = request(1, 7, tokens=2048)
    e.submit(a)
    t = drain(e)
    b = request(2, 7, tokens=2048, at=t)
    e.submit(b)
    drain(e, t)
    assert a.cached_tokens == 0 and b.cached_tokens == 2048 - 16
    assert (b.first_token_at - b.arrival) < (a.first_token_at - a.arrival) / 5
    s = e.stats()
    assert s.prefix_hits == 2032 and s.prefix_queries == 4096 and s.completed == 2


def test_full_hit_still_computes_one_block() -> None:
    e = Engine(EngineConfig())
    e.submit(request(1, 3))
    t = drain(e)
    same = request(1, 3, at=t)
    e.submit(same)
    drain(e, t)
    assert same.cached_tokens == 512 - 16


def test_lru_eviction_is_counted_and_kv_bounds_admission() -> None:
    e = Engine(EngineConfig(num_blocks=40))  # one 512-token request needs 33 blocks
    a, b = request(1, 1, out=16), request(2, 2, out=16)
    e.submit(a)
    e.submit(b)
    res = e.step(0.0)
    assert len(e.waiting) == 1  # b waits for KV: admission is bounded by free blocks
    t = drain(e, res.end)
    assert a.finished_at <= b.first_token_at
    assert e.evictions > 0
    assert e.cached_prefix_blocks(a.hashes) < 31  # a's prefix was partly reused for b
    assert e.kv_usage() == 0.0
    del t


def test_batching_shares_decode_steps_and_chunked_prefill_budget() -> None:
    cfg = EngineConfig(max_batched_tokens=1024, step_ms=10, decode_ms_per_seq=0.0,
                       prefill_ms_per_token=0.1)
    e = Engine(cfg)
    reqs = [request(i, 10 + i, tokens=2048, out=2) for i in range(2)]
    for r in reqs:
        e.submit(r)
    first = e.step(0.0)
    assert first.prefill_tokens == 1024
    assert first.duration == pytest.approx((10 + 0.1 * 1024) / 1000)
    drain(e, first.end)
    assert reqs[0].first_token_at < reqs[1].first_token_at


def test_oversized_request_rejected() -> None:
    e = Engine(EngineConfig(num_blocks=4))
    with pytest.raises(ValueError, match="KV blocks"):
        e.submit(request(1, 1))
