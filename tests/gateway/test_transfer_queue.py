"""The decode side's wait for KV pages (gateway/page_wait.py) on the real engine, in process:
first come first served, ended by the caller's deadline (DEADLINE_EXCEEDED) or, without one,
by the transfer timeout (OVERLOADED, retryable); a waiter holds nothing."""

from __future__ import annotations

import asyncio

import pytest

from gateway.errors import DeadlineExceeded, retry_delay_s
from gateway.page_wait import PageWait
from runtime.async_engine import AsyncLLM
from runtime.disagg.importer import KVImport
from runtime.errors import KVPoolExhausted
from runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_imports_wait_for_pages_in_arrival_order(engine, one_torch_thread):
    llm = AsyncLLM(engine)
    wait = PageWait(llm)
    pool = engine.pool
    ids = engine.tokenizer.encode("queued for pages " * 12)  # a few pages

    def reserve(rid: str):
        return lambda: KVImport.reserve(engine, rid, ids, GREEDY)

    async def scenario() -> None:
        def hog_all() -> list:
            if engine.prefix_cache is not None:
                engine.prefix_cache.clear()
            return [pool.allocate("hog") for _ in range(pool.num_free_pages)]

        hog = await llm.call(hog_all)
        # without a deadline: OVERLOADED after the transfer timeout, retryable, nothing held
        with pytest.raises(KVPoolExhausted) as info:
            await wait.reserve(reserve("a"), 0.2, None)
        assert retry_delay_s(info.value) == 1.0
        with pytest.raises(DeadlineExceeded):
            await wait.reserve(reserve("b"), 60, 0.2)
        assert wait.waiting == 0
        # two waiters; pages come back: the older one is served first
        first = asyncio.create_task(wait.reserve(reserve("c"), 60, 30))
        await asyncio.sleep(0.1)
        second = asyncio.create_task(wait.reserve(reserve("d"), 60, 30))
        await asyncio.sleep(0.1)
        assert wait.waiting == 2 and not first.done()
        need = pool.pages_for_tokens(len(ids))
        await llm.call(lambda: [pool.release(hog.pop()) for _ in range(need)])
        imp = await asyncio.wait_for(first, 10)
        assert imp.request_id == "c" and not second.done() and wait.waiting == 1
        await llm.call(lambda: [pool.release(r) for r in hog])
        later = await asyncio.wait_for(second, 10)
        for done in (imp, later):
            await llm.call(done.abort)

    try:
        asyncio.run(scenario())
    finally:
        llm.shutdown()
