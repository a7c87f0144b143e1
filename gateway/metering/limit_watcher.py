"""Carrying run-time limit changes to every gateway: push where the store has it, poll always.

    watcher = LimitWatcher(store, meter.set_stored_limits, poll_interval_s=0.5)
    await watcher.start()      # the records are loaded (and applied) before it returns
    await watcher.reload()     # after a change made through this instance: applied at once
    await watcher.stop()

As auth/revocation.py carries revocations (both on infra/redis_watch.py): a poll of the store's
limits version every `poll_interval_s` (<= 1 s: the path for the embedded store, whose other
writer is the CLI, and the backup for a lost message) and, on Redis, the pub/sub channel
(milliseconds). Either reloads every record and hands it to `apply`. A store that is down leaves
the last records in force.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from gateway.metering.limit_store import LimitStore, StoredLimits
from infra.redis_watch import ChangeWatch

log = logging.getLogger("aigw.metering")


class LimitWatcher:
    def __init__(self, store: LimitStore, apply: Callable[[StoredLimits], None],
                 poll_interval_s: float) -> None:
        self.store = store
        self._apply = apply
        self._reload_lock = asyncio.Lock()
        self._watch = ChangeWatch(
            "limits", read_version=store.version, on_version=self._reload_at,
            open_feed=store.open_change_feed, on_message=self._reload_on_message,
            poll_interval_s=poll_interval_s, log=log)

    async def start(self) -> None:
        await self.reload()
        await self._watch.start(self._watch.version)

    async def reload(self) -> None:
        """Read the version, then every record, and apply them."""
        async with self._reload_lock:
            version = await self.store.version()
            self._apply(await self.store.load())
            self._watch.version = version

    async def stop(self) -> None:
        await self._watch.stop()

    async def _reload_at(self, version: int) -> None:
        await self.reload()

    async def _reload_on_message(self, scope_field: str) -> None:
        await self.reload()
