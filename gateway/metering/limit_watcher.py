"""Carrying run-time limit changes to every gateway: push where the store has it, poll always.

    watcher = LimitWatcher(store, meter.set_stored_limits, poll_interval_s=0.5)
    await watcher.start()      # the records are loaded (and applied) before it returns
    await watcher.reload()     # after a change made through this instance: applied at once
    await watcher.stop()

As auth/revocation.py carries revocations: a poll of the store's limits version every
`poll_interval_s` (<= 1 s: the path for the embedded store, whose other writer is the CLI, and the
backup for a lost message) and, on Redis, the pub/sub channel (milliseconds). Either reloads every
record and hands it to `apply`. A store that is down leaves the last records in force.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from gateway.metering.limit_store import LimitStore, StoredLimits

log = logging.getLogger("aigw.metering")
_LOG_EVERY_NTH_FAILURE = 60


class LimitWatcher:
    def __init__(self, store: LimitStore, apply: Callable[[StoredLimits], None],
                 poll_interval_s: float) -> None:
        self.store = store
        self._apply = apply
        self._poll_interval_s = poll_interval_s
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._version = 0
        self._reload_lock = asyncio.Lock()

    async def start(self) -> None:
        await self.reload()
        self._tasks.append(asyncio.create_task(self._poll(), name="aigw-limits-poll"))
        self._tasks.append(asyncio.create_task(self._listen(), name="aigw-limits-push"))

    async def reload(self) -> None:
        """Read the version, then every record, and apply them."""
        async with self._reload_lock:
            version = await self.store.version()
            self._apply(await self.store.load())
            self._version = version

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
                if await self.store.version() != self._version:
                    await self.reload()
                num_failures = 0
            except Exception as exc:  # noqa: BLE001 - the store is down: keep the last limits
                num_failures += 1
                if num_failures % _LOG_EVERY_NTH_FAILURE == 1:
                    log.warning("limits poll failed (%d in a row; retrying): %s: %s",
                                num_failures, type(exc).__name__, exc)

    async def _listen(self) -> None:
        while not self._stopping.is_set():
            try:
                feed = await self.store.open_change_feed()
            except Exception as exc:  # noqa: BLE001 - the poll carries changes meanwhile
                log.debug("limits feed unavailable: %s", exc)
                await self._stopped_within(self._poll_interval_s)
                continue
            if feed is None:
                return
            try:
                while not self._stopping.is_set():
                    if await feed.next_key_id(timeout_s=self._poll_interval_s) is not None:
                        await self.reload()
            except Exception as exc:  # noqa: BLE001 - reconnect; the poll covers the gap
                log.warning("limits feed broke; reconnecting: %s: %s", type(exc).__name__, exc)
                await self._stopped_within(self._poll_interval_s)
            finally:
                with contextlib.suppress(Exception):
                    await feed.aclose()

    async def _stopped_within(self, seconds: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout=seconds)
        return self._stopping.is_set()
