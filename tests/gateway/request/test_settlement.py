"""Settlement: an admitted request is settled exactly once, whichever path asks first, and a
settle that fails or is cancelled half-way is never run again."""

from __future__ import annotations

import asyncio

import pytest

from gateway.request.settlement import Settlement


class _Meter:
    def __init__(self, fail: bool = False, wait: asyncio.Event | None = None) -> None:
        self.calls: list[bool] = []
        self._fail = fail
        self._wait = wait

    async def settle_once(self, queue: bool) -> None:
        self.calls.append(queue)
        if self._wait is not None:
            await self._wait.wait()
        if self._fail:
            raise RuntimeError("meter down")


def test_the_second_settle_does_nothing_and_says_so() -> None:
    meter = _Meter()
    settlement = Settlement(meter.settle_once)

    async def both() -> tuple[bool, bool]:
        return await settlement.settle(queue=False), await settlement.settle()

    assert asyncio.run(both()) == (True, False)
    assert meter.calls == [False]  # the first call's way (awaited, before the answer) won
    assert settlement.is_settled


def test_concurrent_settles_meter_once() -> None:
    meter = _Meter()
    settlement = Settlement(meter.settle_once)

    async def many() -> list[bool]:
        return list(await asyncio.gather(*(settlement.settle() for _ in range(8))))

    assert sorted(asyncio.run(many())) == [False] * 7 + [True]
    assert meter.calls == [True]


def test_a_settle_that_raised_is_not_retried_into_a_second_record() -> None:
    meter = _Meter(fail=True)
    settlement = Settlement(meter.settle_once)

    async def twice() -> bool:
        with pytest.raises(RuntimeError):
            await settlement.settle(queue=False)
        return await settlement.settle()

    assert asyncio.run(twice()) is False
    assert meter.calls == [False]


def test_a_settle_cancelled_half_way_is_not_run_again() -> None:
    gate = asyncio.Event()
    meter = _Meter(wait=gate)
    settlement = Settlement(meter.settle_once)

    async def cancel_then_settle() -> bool:
        task = asyncio.ensure_future(settlement.settle(queue=False))
        await asyncio.sleep(0)  # inside settle_once, waiting
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        return await settlement.settle()

    assert asyncio.run(cancel_then_settle()) is False
    assert meter.calls == [False]
