"""Wait timeouts without a loop timer per wait: "this wait for the upstream may last N seconds".

    watchdog = Watchdog()                          # one per pipeline
    async with watchdog.timer() as timer:          # one per request (or WaitTimer(watchdog))
        timer.waiting(first_token_timeout_s)       # a wait starts, with its limit
        first = await anext(events)                # TimeoutError if it runs over
        timer.done_waiting()
        await response.write(...)                  # not a wait: never times out

`asyncio.timeout` around each wait schedules and cancels a loop timer (~10 us on the gateway's
2-core VM, several per request). Here a wait costs two attribute writes, and one watchdog timer,
ticking every `tick_s` while any request is open, checks the open waits: a wait that ran over is
cancelled at most `tick_s` after its limit, and its `async with` raises TimeoutError, as
`asyncio.timeout` does (a cancellation from elsewhere stays a CancelledError).
"""

from __future__ import annotations

import asyncio
from types import TracebackType

TICK_S = 0.05


class Watchdog:
    def __init__(self, tick_s: float = TICK_S) -> None:
        self._tick_s = tick_s
        self._open: set[WaitTimer] = set()
        self._ticking: asyncio.TimerHandle | None = None
        self._ticking_loop: asyncio.AbstractEventLoop | None = None

    def timer(self) -> WaitTimer:
        return WaitTimer(self)

    def _start_ticking(self, loop: asyncio.AbstractEventLoop) -> None:
        self._ticking_loop = loop
        self._ticking = loop.call_later(self._tick_s, self._tick, loop)

    def _remove(self, timer: WaitTimer) -> None:
        self._open.discard(timer)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop is not self._ticking_loop:
            return
        now = loop.time()
        for timer in [t for t in self._open if t.deadline is not None and now >= t.deadline]:
            timer.expire()
        self._ticking = loop.call_later(self._tick_s, self._tick, loop) if self._open else None


class WaitTimer:
    __slots__ = ("_cancelling", "_expired", "_task", "_watchdog", "deadline", "loop")

    def __init__(self, watchdog: Watchdog) -> None:
        self._watchdog = watchdog
        self.deadline: float | None = None  # loop time the open wait must end by
        self._expired = False

    def waiting(self, timeout_s: float) -> None:
        self.deadline = self.loop.time() + timeout_s

    def done_waiting(self) -> None:
        self.deadline = None

    def expire(self) -> None:
        if not self._expired:
            self._expired = True
            self._watchdog._remove(self)
            self._task.cancel()

    async def __aenter__(self) -> WaitTimer:
        self.loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("WaitTimer must be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        watchdog = self._watchdog  # (Watchdog._add, inline: this runs twice a request)
        watchdog._open.add(self)
        if watchdog._ticking is None or watchdog._ticking_loop is not self.loop:
            watchdog._start_ticking(self.loop)  # (or a test's new loop)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        traceback: TracebackType | None) -> None:
        self._watchdog._open.discard(self)
        if self._expired:  # as asyncio.timeout: uncancel what the timer cancelled
            if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc
