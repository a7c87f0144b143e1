"""WaitTimer: "no single wait may last longer than N seconds", with one timer for many waits.

    async with WaitTimer(idle_timeout_s) as timer:
        while ...:
            timer.waiting()               # a wait for the upstream starts
            event = await anext(events)   # TimeoutError if this wait passes idle_timeout_s
            timer.done_waiting()
            await response.write(...)     # not a wait: never times out

Per wait this costs two attribute writes, where `asyncio.timeout` around each wait schedules and
cancels a loop timer (~10 us on the gateway's 2-core VM, several per request). The one timer
here fires at most every `timeout_s` and re-arms itself until a wait has really run over; then
the task is cancelled and the `async with` raises TimeoutError, as `asyncio.timeout` does
(a cancellation from elsewhere stays a CancelledError).
"""

from __future__ import annotations

import asyncio
from types import TracebackType

_EARLY_S = 0.001  # loop timers may fire this much before their deadline


class WaitTimer:
    __slots__ = ("_cancelling", "_expired", "_handle", "_loop", "_task", "_timeout_s",
                 "_wait_started")

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._wait_started: float | None = None
        self._expired = False
        self._handle: asyncio.TimerHandle | None = None

    def waiting(self) -> None:
        self._wait_started = self._loop.time()

    def done_waiting(self) -> None:
        self._wait_started = None

    async def __aenter__(self) -> WaitTimer:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("WaitTimer must be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._handle = self._loop.call_at(self._loop.time() + self._timeout_s, self._check)
        return self

    def _check(self) -> None:
        now = self._loop.time()
        started = self._wait_started
        if started is None:
            self._handle = self._loop.call_at(now + self._timeout_s, self._check)
        elif now - started >= self._timeout_s - _EARLY_S:
            self._handle = None
            self._expired = True
            self._task.cancel()
        else:
            self._handle = self._loop.call_at(started + self._timeout_s, self._check)

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        traceback: TracebackType | None) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._expired:  # as asyncio.timeout: uncancel what the timer cancelled
            if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc
