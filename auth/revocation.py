"""Carrying revocations to every instance: push where the store has it, poll always.

Two background tasks empty the authenticator's key cache:
    push  Redis pub/sub on the revocation channel: drops the named key at once (milliseconds)
    poll  reads the store's revocation version every `poll_interval_s` (<= 1 s); on any change it
          drops the whole cache. It is the backup when a pub/sub message is lost, and the only
          path for the embedded store, where another process (the CLI) may revoke.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from auth.authenticator import KeyAuthenticator
from auth.store import KeyStore

log = logging.getLogger(__name__)


class RevocationWatcher:
    def __init__(self, store: KeyStore, authenticator: KeyAuthenticator,
                 poll_interval_s: float) -> None:
        self._store = store
        self._authenticator = authenticator
        self._poll_interval_s = poll_interval_s
        self._tasks: list[asyncio.Task[None]] = []
        self._version = 0

    async def start(self) -> None:
        self._version = await self._store.revocation_version()
        self._tasks.append(asyncio.create_task(self._poll(), name="aigw-revocation-poll"))
        if self._store.changed_key_ids() is not None:
            self._tasks.append(asyncio.create_task(self._listen(), name="aigw-revocation-push"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._poll_interval_s)
            try:
                version = await self._store.revocation_version()
            except Exception:  # the store is down: keep serving from the cache, retry next tick
                log.warning("revocation poll failed", exc_info=True)
                continue
            if version != self._version:
                self._version = version
                self._authenticator.invalidate()

    async def _listen(self) -> None:
        while True:
            feed = self._store.changed_key_ids()
            if feed is None:
                return
            try:
                async for key_id in feed:
                    self._authenticator.invalidate(key_id)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("revocation feed broke; reconnecting", exc_info=True)
            await asyncio.sleep(self._poll_interval_s)
