"""Concurrent store calls share a batch; each caller gets its own result or error."""

from __future__ import annotations

import asyncio

import pytest
import redis as sync_redis

from gateway.metering import Limits, MeteringSettings, open_meter
from gateway.metering.coalescer import Coalescer
from tests.gateway.metering.conftest import principal, record


def test_calls_made_together_are_flushed_as_one_batch_with_per_item_results() -> None:
    batches: list[list[int]] = []

    async def flush(items: list[int]) -> list[int | BaseException]:
        batches.append(items)
        await asyncio.sleep(0.01)
        return [ValueError(f"bad {i}") if i < 0 else i * 10 for i in items]

    async def scenario() -> list[object]:
        coalescer: Coalescer[int, int] = Coalescer(flush)
        results = await asyncio.gather(*(coalescer.submit(i) for i in (1, 2, -3, 4)),
                                       return_exceptions=True)
        late = await coalescer.submit(5)
        await coalescer.close()
        return [*results, late]

    results = asyncio.run(scenario())
    assert results[:2] == [10, 20] and isinstance(results[2], ValueError)
    assert results[3:] == [40, 50]
    assert batches[0] == [1, 2, -3, 4] and batches[-1] == [5]


def test_a_cancelled_caller_does_not_stop_its_item_from_being_written() -> None:
    written: list[int] = []

    async def flush(items: list[int]) -> list[int | BaseException]:
        await asyncio.sleep(0.01)
        written.extend(items)
        return items

    async def scenario() -> None:
        coalescer: Coalescer[int, int] = Coalescer(flush)
        caller = asyncio.create_task(coalescer.submit(7))
        await asyncio.sleep(0)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        await coalescer.close()

    asyncio.run(scenario())
    assert written == [7]


def test_the_redis_meter_reloads_its_scripts_after_a_script_flush(clean_redis_url: str) -> None:
    async def scenario() -> None:
        meter = await open_meter(MeteringSettings(
            default_project_limits=Limits(requests_per_minute=5)), redis=clean_redis_url)
        try:
            await meter.settle(await meter.admit("a", principal(), "m", 1, 1), record("a", 1, 1))
            client = sync_redis.Redis.from_url(clean_redis_url)
            client.script_flush()
            client.close()
            await meter.settle(await meter.admit("b", principal(), "m", 1, 1), record("b", 1, 1))
            assert [r.request_id for r in await meter.usage_records("acme")] == ["a", "b"]
        finally:
            await meter.close()

    asyncio.run(scenario())


def test_queued_items_linger_for_company_but_a_waiting_call_flushes_at_once() -> None:
    batches: list[list[int]] = []
    results: list[object] = []

    async def flush(items: list[int]) -> list[int | BaseException]:
        batches.append(items)
        return [i * 10 for i in items]

    async def scenario() -> float:
        coalescer: Coalescer[int, int] = Coalescer(flush, linger_s=0.05)
        for i in (1, 2):
            coalescer.submit_nowait(i, results.append)
            await asyncio.sleep(0.01)  # far less than the linger: same batch
        await coalescer.flush()
        coalescer.submit_nowait(3, results.append)
        started = asyncio.get_running_loop().time()
        assert await coalescer.submit(4) == 40  # does not wait out the linger
        waited = asyncio.get_running_loop().time() - started
        await coalescer.close()
        return waited

    waited = asyncio.run(scenario())
    assert batches == [[1, 2], [3, 4]] and results == [10, 20, 30] and waited < 0.04


def test_items_queued_during_a_flush_linger_again_instead_of_flushing_one_by_one() -> None:
    """At concurrency 1 each request's row arrives while the previous batch is being written:
    it waits a linger for company rather than starting a transaction of its own."""
    batches: list[list[int]] = []
    results: list[object] = []

    async def flush(items: list[int]) -> list[int | BaseException]:
        batches.append(items)
        await asyncio.sleep(0.02)
        return [i * 10 for i in items]

    async def scenario() -> float:
        coalescer: Coalescer[int, int] = Coalescer(flush, linger_s=0.05)
        coalescer.submit_nowait(1, results.append)
        await asyncio.sleep(0.06)  # the linger is over: [1] is being written
        assert batches == [[1]]
        coalescer.submit_nowait(2, results.append)  # arrives during that write
        await asyncio.sleep(0.03)  # the write is done; 2 waits for company
        coalescer.submit_nowait(3, results.append)
        await asyncio.sleep(0.005)
        assert batches == [[1]]
        started = asyncio.get_running_loop().time()
        await coalescer.flush()  # a reader does not wait out the linger
        return asyncio.get_running_loop().time() - started

    waited = asyncio.run(scenario())
    assert batches == [[1], [2, 3]] and results == [10, 20, 30] and waited < 0.04
