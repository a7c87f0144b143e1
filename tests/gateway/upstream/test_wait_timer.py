"""Watchdog timers: only a single wait longer than its limit times out; other time never counts."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.upstream.wait_timer import Watchdog


def test_time_between_waits_does_not_count_but_one_long_wait_does() -> None:
    watchdog = Watchdog(tick_s=0.01)

    async def scenario() -> float:
        async with watchdog.timer() as timer:
            for _ in range(3):  # 3 waits of 0.06 s with 0.15 s of other work after each
                timer.waiting(0.1)
                await asyncio.sleep(0.06)
                timer.done_waiting()
                await asyncio.sleep(0.15)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            async with watchdog.timer() as timer:
                await asyncio.sleep(0.12)  # not a wait
                timer.waiting(0.1)
                await asyncio.sleep(10)
        return time.monotonic() - started

    assert 0.2 <= asyncio.run(scenario()) < 1.0  # 0.12 s of work, then the 0.1 s limit
    assert asyncio.run(scenario()) >= 0.2  # the same watchdog on a new event loop still ticks


def test_a_cancellation_from_elsewhere_stays_a_cancellation() -> None:
    async def scenario() -> None:
        async def waiter() -> None:
            async with Watchdog().timer() as timer:
                timer.waiting(5)
                await asyncio.sleep(10)

        task = asyncio.create_task(waiter())
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
