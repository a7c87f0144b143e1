"""Carrying revocations to every instance: push where the store has it, poll always.

Two background tasks empty the authenticator's key cache:
    push  Redis pub/sub on the revocation channel: drops the named key at once (milliseconds)
    poll  reads the store's revocation version every `poll_interval_s` (<= 1 s); on any change it
          drops the whole cache. It is the backup when a pub/sub message is lost, and the only
          path for the embedded store, where another process (the CLI) may revoke.
Both loops stop on a flag checked at least every poll interval (never by cancelling a read).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from auth.authenticator import KeyAuthenticator
from auth.store import KeyStore, StoreError

log = logging.getLogger(__name__)
_LOG_EVERY_NTH_FAILURE = 60  # a store down for a while: one line about every 30 s per loop, not two a second


def _log_failure(what: str, num_failures: int, exc: Exception) -> None:
    """One warning line on the first failure in a row and every Nth after it; a traceback only
    for what is not an outage (a bug in a loop must still show where it is)."""
    if num_failures % _LOG_EVERY_NTH_FAILURE == 1:
        log.warning("%s (%d in a row; retrying): %s: %s", what, num_failures,
                    type(exc).__name__, exc, exc_info=not _is_outage(exc))


def _is_outage(exc: Exception) -> bool:
    """The store down or not answering (Redis, the network, SQLite), as opposed to a bug."""
    import sqlite3

    from redis.exceptions import RedisError

    return isinstance(exc, OSError | RedisError | sqlite3.Error | StoreError)


class RevocationWatcher:
    def __init__(self, store: KeyStore, authenticator: KeyAuthenticator,
                 poll_interval_s: float) -> None:
        self._store = store
        self._authenticator = authenticator
        self._poll_interval_s = poll_interval_s
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._version = 0

    async def start(self) -> None:
        self._version = await self._store.revocation_version()
        self._tasks.append(asyncio.create_task(self._poll(), name="aigw-revocation-poll"))
        self._tasks.append(asyncio.create_task(self._listen(), name="aigw-revocation-push"))

    async def stop(self) -> None:
        self._stopping.set()
        for task in self._tasks:
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout=5 * self._poll_interval_s + 1)
            except TimeoutError:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._tasks.clear()

    async def _poll(self) -> None:
        num_failures = 0
        while not await self._stopped_within(self._poll_interval_s):
            try:
                version = await self._store.revocation_version()
            except Exception as exc:  # the store is down: keep serving from the cache, retry next tick
                num_failures += 1
                _log_failure("revocation poll failed", num_failures, exc)
                continue
            if num_failures:
                log.warning("revocation poll recovered after %d failures", num_failures)
                num_failures = 0
            if version != self._version:
                self._version = version
                self._authenticator.invalidate()

    async def _listen(self) -> None:
        num_failures = 0
        while not self._stopping.is_set():
            try:
                feed = await self._store.open_change_feed()
            except Exception as exc:
                num_failures += 1
                _log_failure("revocation feed unavailable", num_failures, exc)
                await self._stopped_within(self._poll_interval_s)
                continue
            if feed is None:
                return
            if num_failures:
                log.warning("revocation feed back after %d failures", num_failures)
                num_failures = 0
            try:
                while not self._stopping.is_set():
                    key_id = await feed.next_key_id(timeout_s=self._poll_interval_s)
                    if key_id is not None:
                        self._authenticator.invalidate(key_id)
            except Exception as exc:
                log.warning("revocation feed broke; reconnecting: %s: %s", type(exc).__name__, exc,
                            exc_info=not _is_outage(exc))
                await self._stopped_within(self._poll_interval_s)
            finally:
                with contextlib.suppress(Exception):
                    await feed.aclose()

    async def _stopped_within(self, seconds: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout=seconds)
        return self._stopping.is_set()
