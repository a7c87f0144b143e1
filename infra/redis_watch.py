"""Carrying a shared record's changes to every instance: push where Redis has it, poll always.

    watch = ChangeWatch("revocation", read_version=store.revocation_version,
                        on_version=lambda version: drop_all(), open_feed=store.open_change_feed,
                        on_message=drop_one, poll_interval_s=0.5, log=log)
    await watch.start(await store.revocation_version())
    ...
    await watch.stop()

Two background tasks:
    poll  reads the version every `poll_interval_s` (<= 1 s); when it differs from the last one
          seen, awaits `on_version(version)`. The backup when a pub/sub message is lost, and the
          only path for a store without push (SQLite, where another process such as the CLI writes)
    push  reads the feed `open_feed()` returns (a Redis pub/sub channel: `open_pubsub_feed`) and
          awaits `on_message(data)` for each message (milliseconds); a feed of None ends it
A store that is down leaves the caller's state as it is: one warning line on the first failure of a
stretch and every 60th after it (a traceback only for an error that is no outage: a bug must show
where it is), and a line when it is back. Both loops stop on a flag checked at least every poll
interval, never by cancelling a read (redis-py may swallow a cancellation that lands inside a
blocking pub/sub read). Torch-free and gateway-free: auth/ and gateway/ both use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from infra.event_wait import event_set_within

LOG_EVERY_NTH_FAILURE = 60  # a store down for a while: one line about every 30 s per loop


class ChangeFeed(Protocol):
    async def next_key_id(self, timeout_s: float) -> str | None:
        """The next message's data (a changed key id, a scope), or None when none came within
        timeout_s."""
        ...

    async def aclose(self) -> None: ...


class PubSubFeed:
    """A Redis pub/sub subscription read with a timeout instead of being cancelled."""

    def __init__(self, pubsub: Any) -> None:
        self._pubsub = pubsub

    async def next_key_id(self, timeout_s: float) -> str | None:
        message = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout_s)
        if message is None or message.get("type") != "message":
            return None
        return str(message["data"])

    async def aclose(self) -> None:
        await self._pubsub.aclose()


async def open_pubsub_feed(client: Any, channel: str) -> PubSubFeed:
    """`client` (a decoding redis.asyncio client, plain or cluster) subscribed to `channel`. On a
    cluster the PUBLISH of any node reaches the subscriber (the cluster bus carries it)."""
    from infra.redis_client import is_cluster_client

    if is_cluster_client(client):  # its pub/sub needs the slot map of an opened client
        await client.initialize()
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(channel)
    return PubSubFeed(pubsub)


def is_outage(exc: BaseException, extra: tuple[type[BaseException], ...] = ()) -> bool:
    """The store down or not answering (Redis, the network, SQLite), as opposed to a bug."""
    from redis.exceptions import RedisError

    return isinstance(exc, OSError | RedisError | sqlite3.Error) or isinstance(
        exc, extra)


class ChangeWatch:
    """`name` starts each log line ("revocation poll failed ..."); `outage_errors` are more
    exception types that mean the store is down (no traceback)."""

    def __init__(self, name: str, *, read_version: Callable[[], Awaitable[int]],
                 on_version: Callable[[int], Awaitable[None]],
                 open_feed: Callable[[], Awaitable[ChangeFeed | None]],
                 on_message: Callable[[str], Awaitable[None]], poll_interval_s: float,
                 log: logging.Logger, outage_errors: tuple[type[BaseException], ...] = ()) -> None:
        self.name = name
        self.version = 0  # the last version seen (or applied by the caller)
        self._read_version = read_version
        self._on_version = on_version
        self._open_feed = open_feed
        self._on_message = on_message
        self._poll_interval_s = poll_interval_s
        self._log = log
        self._outage_errors = outage_errors
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, version: int) -> None:
        """Watch from `version` (the caller's state is current as of it)."""
        self.version = version
        self._stopping.clear()
        self._tasks.append(asyncio.create_task(self._poll(), name=f"aigw-{self.name}-poll"))
        self._tasks.append(asyncio.create_task(self._listen(), name=f"aigw-{self.name}-push"))

    async def stop(self) -> None:
        """Both loops end within about a poll interval (a task that does not is cancelled)."""
        self._stopping.set()
        for task in self._tasks:
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout=5 * self._poll_interval_s + 1)
            except TimeoutError:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._tasks.clear()

    def _log_failure(self, what: str, num_failures: int, exc: Exception) -> None:
        if num_failures % LOG_EVERY_NTH_FAILURE == 1:
            self._log.warning("%s %s (%d in a row; retrying): %s: %s", self.name, what,
                              num_failures, type(exc).__name__, exc,
                              exc_info=not is_outage(exc, self._outage_errors))

    async def _poll(self) -> None:
        num_failures = 0
        while not await self._stopped_within(self._poll_interval_s):
            try:
                version = await self._read_version()
                if version != self.version:
                    previous, self.version = self.version, version
                    try:
                        await self._on_version(version)
                    except BaseException:
                        self.version = previous  # not applied: the next poll tries again
                        raise
            except Exception as exc:  # the store is down: keep the last state, retry next tick
                num_failures += 1
                self._log_failure("poll failed", num_failures, exc)
                continue
            if num_failures:
                self._log.warning("%s poll recovered after %d failures", self.name, num_failures)
                num_failures = 0

    async def _listen(self) -> None:
        num_failures = 0
        while not self._stopping.is_set():
            try:
                feed = await self._open_feed()
            except Exception as exc:  # the poll carries changes meanwhile
                num_failures += 1
                self._log_failure("feed unavailable", num_failures, exc)
                await self._stopped_within(self._poll_interval_s)
                continue
            if feed is None:
                return
            if num_failures:
                self._log.warning("%s feed back after %d failures", self.name, num_failures)
                num_failures = 0
            try:
                while not self._stopping.is_set():
                    data = await feed.next_key_id(timeout_s=self._poll_interval_s)
                    if data is not None:
                        await self._on_message(data)
            except Exception as exc:  # reconnect; the poll covers the gap
                self._log.warning("%s feed broke; reconnecting: %s: %s", self.name,
                                  type(exc).__name__, exc,
                                  exc_info=not is_outage(exc, self._outage_errors))
                await self._stopped_within(self._poll_interval_s)
            finally:
                with contextlib.suppress(Exception):
                    await feed.aclose()

    async def _stopped_within(self, seconds: float) -> bool:
        await event_set_within(self._stopping, seconds)
        return self._stopping.is_set()
