"""Coalescing many small store calls into one round trip (a Redis pipeline, a SQLite transaction).

    coalescer = Coalescer(flush)              # flush(items) -> one result (or exception) per item
    result = await coalescer.submit(item)     # waits for the batch that carries `item`
    coalescer.submit_nowait(item, on_result)  # returns at once; on_result(result or exception)
                                              # is called when its batch is done
    await coalescer.flush()                   # everything submitted so far is done

At most one flush is in flight: calls made while it runs form the next batch. Under load (the
gateway at concurrency 16) this turns N round trips and N event-loop wakeups into one; alone, a
call costs one round trip as before. Each item keeps its own atomicity (a Lua script, a row).
With `linger_s`, queued `submit_nowait` items wait that long for company before they are
flushed: when they find nothing in flight, and again when a flush ends with only such items left.
Nobody waits on them; a `submit` or `flush` in the meantime flushes at once. So even one request
at a time shares its store round trip with its neighbours: at concurrency 1 a batch is the
requests of one linger (~10 per SQLite transaction at 1 ms a request), not one, which had the
store's thread contend for the GIL with the event loop on every request.

With `size_of`, `backlog_bytes` is what the items queued or in flight weigh (their store calls,
by `size_of`), until their results are delivered: a store that hangs instead of failing leaves
it growing, and the meters refuse new requests past their bound (back-pressure, MeterBacklogged)
rather than let it grow or drop an item.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

log = logging.getLogger("aigw.metering")


class Coalescer(Generic[T, R]):
    def __init__(self, flush: Callable[[list[T]], Awaitable[list[R | BaseException]]],
                 max_batch: int = 256, linger_s: float = 0.0,
                 size_of: Callable[[T], int] | None = None) -> None:
        self._flush = flush
        self._size_of = size_of
        self.backlog_bytes = 0  # of the items submitted and not yet delivered (with size_of)
        self._max_batch = max_batch
        self._linger_s = linger_s
        self._linger: asyncio.TimerHandle | None = None
        # each item with its waiter: a future (submit) or a callback (submit_nowait)
        self._pending: list[tuple[T, asyncio.Future[R] | Callable[[R | BaseException], None]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._num_flush_waiters = 0  # flush() callers: while any wait, nothing lingers

    async def submit(self, item: T) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        self._weigh(item, 1)
        self._start()
        return await future

    def submit_nowait(self, item: T, on_result: Callable[[R | BaseException], None]) -> None:
        """Queue `item`; `on_result` gets its result or exception (also on cancellation) and
        must not raise (what it raises is logged)."""
        self._pending.append((item, on_result))
        self._weigh(item, 1)
        if self._linger_s <= 0.0:
            self._start()
        elif self._linger is None and (self._flusher is None or self._flusher.done()):
            self._linger = asyncio.get_running_loop().call_later(self._linger_s, self._start)

    def _weigh(self, item: T, sign: int) -> None:
        if self._size_of is not None:
            self.backlog_bytes += sign * self._size_of(item)

    def _deliver_batch(self, batch: list[tuple[T, asyncio.Future[R]
                                               | Callable[[R | BaseException], None]]],
                       results: list[R | BaseException]) -> None:
        for (item, waiter), result in zip(batch, results, strict=True):
            self._weigh(item, -1)
            _deliver(waiter, result)

    def _start(self) -> None:
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        while self._pending:
            batch = self._pending[:self._max_batch]
            del self._pending[:self._max_batch]
            try:
                results = await self._flush([item for item, _ in batch])
            except BaseException as exc:  # noqa: BLE001 - handed to every waiter of the batch
                results = [exc] * len(batch)
                if isinstance(exc, asyncio.CancelledError):
                    self._deliver_batch(batch, results)
                    raise
            self._deliver_batch(batch, results)
            if self._pending and self._linger_s > 0.0 and self._may_linger():
                self._linger = asyncio.get_running_loop().call_later(self._linger_s, self._start)
                return

    def _may_linger(self) -> bool:
        """Between batches: only queued items are left and nobody waits for a flush."""
        return self._num_flush_waiters == 0 and not any(
            isinstance(waiter, asyncio.Future) for _, waiter in self._pending)

    async def flush(self) -> None:
        """Wait until everything submitted so far has been flushed."""
        self._num_flush_waiters += 1
        try:
            while self._linger is not None or (self._flusher is not None
                                               and not self._flusher.done()):
                if self._linger is not None:
                    self._start()
                assert self._flusher is not None
                await asyncio.wait((self._flusher,))  # never raises what the flusher raised
        finally:
            self._num_flush_waiters -= 1

    async def close(self) -> None:
        """Wait for what is already submitted to be flushed."""
        await self.flush()


def _deliver(waiter: asyncio.Future[R] | Callable[[R | BaseException], None],
             result: R | BaseException) -> None:
    if isinstance(waiter, asyncio.Future):
        if waiter.done():  # its caller was cancelled
            return
        if isinstance(result, asyncio.CancelledError):
            waiter.cancel()
        elif isinstance(result, BaseException):
            waiter.set_exception(result)
        else:
            waiter.set_result(result)
        return
    try:
        waiter(result)
    except Exception:  # noqa: BLE001 - one callback must not stop the others
        log.exception("a coalesced call's callback failed")
