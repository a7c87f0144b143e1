"""Carrying revocations to every instance: push where the store has it, poll always.

Two background tasks (infra/redis_watch.py) empty the authenticator's key cache:
    push  Redis pub/sub on the revocation channel: drops the named key at once (milliseconds)
    poll  reads the store's revocation version every `poll_interval_s` (<= 1 s); on any change it
          drops the whole cache. It is the backup when a pub/sub message is lost, and the only
          path for the embedded store, where another process (the CLI) may revoke.
Both loops stop on a flag checked at least every poll interval (never by cancelling a read).
"""

from __future__ import annotations

import logging

from auth.authenticator import KeyAuthenticator
from auth.store import KeyStore, StoreError
from infra.redis_watch import ChangeWatch

log = logging.getLogger(__name__)


class RevocationWatcher:
    def __init__(self, store: KeyStore, authenticator: KeyAuthenticator,
                 poll_interval_s: float) -> None:
        self._store = store
        self._authenticator = authenticator
        self._watch = ChangeWatch(
            "revocation", read_version=store.revocation_version, on_version=self._drop_all,
            open_feed=store.open_change_feed, on_message=self._drop_key,
            poll_interval_s=poll_interval_s, log=log, outage_errors=(StoreError,))

    async def start(self) -> None:
        await self._watch.start(await self._store.revocation_version())

    async def stop(self) -> None:
        await self._watch.stop()

    async def _drop_all(self, version: int) -> None:
        self._authenticator.invalidate()

    async def _drop_key(self, key_id: str) -> None:
        self._authenticator.invalidate(key_id)
