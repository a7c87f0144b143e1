"""event_set_within: wait for an asyncio.Event with a timeout, cancellable at every moment.

    while not await event_set_within(stopping, poll_interval_s):
        ...   # a background loop: cancelling its task always ends it

`asyncio.wait_for(event.wait(), timeout)` on Python 3.11 swallows a cancel that lands in the same
loop tick as the event being set (it returns the inner result instead of raising), so a loop
around it keeps running after its task was cancelled and an app's cleanup that awaits the task
never ends. `asyncio.timeout` tells its own cancel from the caller's, so nothing is swallowed.
"""

from __future__ import annotations

import asyncio


async def event_set_within(event: asyncio.Event, timeout_s: float) -> bool:
    """Whether `event` is set within `timeout_s` seconds (False on the timeout; a cancel of the
    calling task is raised, never swallowed)."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True
