"""infra/event_wait.py: a background loop waiting on an event ends when its task is cancelled,
even when the cancel lands in the tick the event is set (asyncio.wait_for on Python 3.11 swallowed
that cancel: the batch runner kept running and the gateway's cleanup never ended)."""

from __future__ import annotations

import asyncio

from infra.event_wait import event_set_within


def test_a_cancel_in_the_tick_the_event_is_set_ends_the_loop() -> None:
    async def scenario() -> tuple[bool, list[bool]]:
        event = asyncio.Event()
        seen: list[bool] = []

        async def loop() -> None:
            while True:
                event.clear()
                seen.append(await event_set_within(event, 10.0))

        task = asyncio.create_task(loop())
        await asyncio.sleep(0.01)
        event.set()
        task.cancel()  # the same tick
        done, _ = await asyncio.wait([task], timeout=2.0)
        if not done:
            task.cancel()
        return bool(done) and task.cancelled(), seen

    ended, seen = asyncio.run(scenario())
    assert ended and seen == []


def test_the_wait_says_whether_the_event_was_set_in_time() -> None:
    async def scenario() -> tuple[bool, bool]:
        event = asyncio.Event()
        timed_out = await event_set_within(event, 0.01)
        asyncio.get_running_loop().call_later(0.01, event.set)
        return timed_out, await event_set_within(event, 5.0)

    assert asyncio.run(scenario()) == (False, True)
