"""Coalescing many small store calls into one round trip (a Redis pipeline, a SQLite transaction).

    coalescer = Coalescer(flush)              # flush(items) -> one result (or exception) per item
    result = await coalescer.submit(item)     # waits for the batch that carries `item`

At most one flush is in flight: calls made while it runs form the next batch. Under load (the
gateway at concurrency 16) this turns N round trips and N event-loop wakeups into one; alone, a
call costs one round trip as before. Each item keeps its own atomicity (a Lua script, a row).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Coalescer(Generic[T, R]):
    def __init__(self, flush: Callable[[list[T]], Awaitable[list[R | BaseException]]],
                 max_batch: int = 256) -> None:
        self._flush = flush
        self._max_batch = max_batch
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._flusher: asyncio.Task[None] | None = None

    async def submit(self, item: T) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._pending:
            batch = self._pending[:self._max_batch]
            del self._pending[:self._max_batch]
            try:
                results = await self._flush([item for item, _ in batch])
            except BaseException as exc:  # noqa: BLE001 - handed to every waiter of the batch
                results = [exc] * len(batch)
                if isinstance(exc, asyncio.CancelledError):
                    for _, future in batch:
                        future.cancel()
                    raise
            for (_, future), result in zip(batch, results, strict=True):
                if future.done():  # its caller was cancelled
                    continue
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)

    async def close(self) -> None:
        """Wait for what is already submitted to be flushed."""
        if self._flusher is not None and not self._flusher.done():
            await self._flusher
