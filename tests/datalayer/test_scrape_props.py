"""The scrape loop: llama.cpp workers' slots from GET /props (read once per worker, again after
a failure or a restart), one worker's slow scrape not delaying the others', a joining worker
scraped at once, and only workers declared ready scraped."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web

from cachepilot.core import BlockConfig, Pool, PoolSpec, Router, WorkerState
from cachepilot.datalayer.engines import parse_props
from cachepilot.datalayer.scrape import Scraper, StaticTargets, error_text

from helpers.polling import eventually

METRICS = """# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing {processing}
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total {queries}
# TYPE llamacpp:prompt_tokens_cached_total counter
llamacpp:prompt_tokens_cached_total 0
"""


class FakeLlama:
    def __init__(self) -> None:
        self.props_calls = 0
        self.slots_calls = 0
        self.processing = 1
        self.queries = 1000
        self.up = True
        self.delay_s = 0.0
        self.connection: dict[str, list[str | None]] = {}  # path → each request's header

    def app(self) -> web.Application:
        @web.middleware
        async def note_connection(request: web.Request, handler):  # type: ignore[no-untyped-def]
            self.connection.setdefault(request.path, []).append(
                request.headers.get("Connection"))
            return await handler(request)

        async def metrics(_: web.Request) -> web.Response:
            await asyncio.sleep(self.delay_s)
            if not self.up:
                return web.Response(status=503)
            return web.Response(text=METRICS.format(queries=self.queries,
                                                    processing=self.processing))

        async def props(_: web.Request) -> web.Response:
            self.props_calls += 1
            return web.json_response({"total_slots": 4, "default_generation_settings":
                                      {"n_ctx": 2048, "temperature": 0.8}})

        async def slots(_: web.Request) -> web.Response:
            self.slots_calls += 1
            return web.json_response([{"is_processing": True, "n_prompt_tokens_processed": 256,
                                       "next_token": [{"n_decoded": 0}]}])

        app = web.Application(middlewares=[note_connection])
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/props", props)
        app.router.add_get("/slots", slots)
        return app


async def serve(fake: FakeLlama) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(fake.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"127.0.0.1:{port}"


def pool_with(addresses: list[str], engine: str) -> tuple[Router, Pool]:
    pool = Pool(PoolSpec(block=BlockConfig(16, 4.0)))
    for a in addresses:
        pool.upsert_worker(a, labels={"engine": engine})
    return Router([pool]), pool


@asynccontextmanager
async def scraping_one(fake: FakeLlama) -> AsyncIterator[tuple[Scraper, WorkerState]]:
    """A scraper of one fake llama.cpp worker, and that worker's state in the pool."""
    runner, addr = await serve(fake)
    router, pool = pool_with([addr], "llamacpp")
    scraper = Scraper(router, StaticTargets(timeout_s=2.0))
    try:
        yield scraper, pool.workers[addr]
    finally:
        await scraper.close()
        await runner.cleanup()


def test_llamacpp_scrapes_close_their_connection() -> None:
    """llama-server polls every kept-alive connection while idle, on the cores it computes on
    (benchmarks/llama_idle_cpu.py): each scrape of /metrics, /props and /slots asks it to
    close the connection after the answer."""
    async def main() -> None:
        fake = FakeLlama()
        async with scraping_one(fake) as (scraper, w):
            for _ in range(2):
                await scraper.scrape_all()
            assert w.ready
        assert fake.slots_calls and fake.props_calls  # all three were read
        assert fake.connection == {"/metrics": ["close"] * 2, "/props": ["close"],
                                   "/slots": ["close"] * 2}

    asyncio.run(main())


def test_parse_props_reads_slots_and_context_per_slot() -> None:
    assert parse_props(b'{"total_slots": 2, "default_generation_settings": {"n_ctx": 4096}}'
                       ) == (2, 4096)
    assert parse_props(b'{"total_slots": 0}') == (None, None)
    assert parse_props(b'{"n_ctx": 512, "total_slots": 1}') == (1, 512)


def test_llamacpp_slots_come_from_props_once_and_again_after_a_failure_or_restart() -> None:
    async def main() -> None:
        fake = FakeLlama()
        async with scraping_one(fake) as (scraper, w):
            for _ in range(3):
                await scraper.scrape_all()
                assert w.metrics is not None
                assert (w.metrics.slots, w.metrics.slot_tokens) == (4, 2048)
            assert fake.props_calls == 1  # once per worker
            fake.up = False
            await scraper.scrape_all()
            assert not w.ready and w.metrics.slots == 4  # the old scrape is kept
            fake.up = True
            await scraper.scrape_all()
            assert w.ready and fake.props_calls == 2  # back: read again
            fake.queries = 10  # counters went back: the engine restarted
            await scraper.scrape_all()
            assert fake.props_calls == 3 and w.metrics.slots == 4
    asyncio.run(main())


def test_llamacpp_prefill_progress_is_read_only_while_a_request_is_processing() -> None:
    """/slots is answered by the engine's main loop: an idle worker is not asked."""
    async def main() -> None:
        fake = FakeLlama()
        async with scraping_one(fake) as (scraper, w):
            fake.processing = 0
            for _ in range(3):
                await scraper.scrape_all()
            assert fake.slots_calls == 0 and w.metrics.prefill_done_tokens == 0
            fake.processing = 1
            await scraper.scrape_all()
            assert fake.slots_calls == 1 and w.metrics.prefill_done_tokens == 256
    asyncio.run(main())


def test_a_slow_worker_does_not_delay_the_others_refresh() -> None:
    async def main() -> None:
        fast, slow = FakeLlama(), FakeLlama()
        slow.delay_s = 5.0  # hung: longer than the scrape timeout
        servers = [await serve(fast), await serve(slow)]
        addrs = [a for _, a in servers]
        router, pool = pool_with(addrs, "llamacpp")
        scraper = Scraper(router, StaticTargets(interval_s=0.1, timeout_s=1.0))
        task = asyncio.create_task(scraper.run())
        try:
            fast_w, slow_w = pool.workers[addrs[0]], pool.workers[addrs[1]]
            # Within 2.5 s the hung worker's scrape has timed out (1 s), and the fast one is
            # scraped ~every 0.1 s meanwhile, not every 1 s.
            await eventually(lambda: scraper.scrapes[addrs[0]] >= 10
                             and "TimeoutError" in slow_w.down.get("scrape", ""), timeout=2.5,
                             what="10 scrapes of the fast worker, the slow one's timed out")
            assert time.time() - fast_w.metrics.scraped_at < 0.5  # type: ignore[union-attr]
            assert not slow_w.ready and "TimeoutError" in slow_w.down["scrape"]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            for runner, _ in servers:
                await runner.cleanup()
    asyncio.run(main())


def test_only_ready_workers_are_scraped_and_a_joining_one_at_once() -> None:
    async def main() -> None:
        fake = FakeLlama()
        runner, addr = await serve(fake)
        pool = Pool(PoolSpec(block=BlockConfig(16, 4.0)))
        pool.upsert_worker(addr, ready=False, labels={"engine": "llamacpp"})
        scraper = Scraper(Router([pool]), StaticTargets(interval_s=3600, timeout_s=2.0))
        try:
            await scraper.scrape_all()
            assert scraper.scrapes == {} and pool.workers[addr].metrics is None  # not ready
            pool.set_ready(addr, True)
            # It just joined: scraped now, not after an hour's interval...
            scraper.scrape_soon("default", addr)
            await eventually(lambda: scraper.scrapes.get(addr) == 1, what="the first scrape")
            assert pool.workers[addr].metrics.slots == 4  # type: ignore[union-attr]
            # ...and asked again (it became ready again), its sleeping loop scrapes at once.
            scraper.scrape_soon("default", addr)
            await eventually(lambda: scraper.scrapes.get(addr) == 2, what="the second scrape")
        finally:
            await scraper.close()
            await runner.cleanup()
    asyncio.run(main())


def test_a_failure_says_its_type_and_is_bounded() -> None:
    assert error_text(TimeoutError()) == "TimeoutError"
    assert error_text(ValueError("bad")) == "ValueError: bad"
    assert len(error_text(ValueError("x" * 1000))) == 200
