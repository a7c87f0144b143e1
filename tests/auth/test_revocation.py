"""A key revoked through one instance is refused by another within a second."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from auth import AuthError, Scope, open_auth
from auth.settings import AuthSettings


async def _seconds_until_refused(authenticate, key: str, limit_s: float) -> float | None:  # type: ignore[no-untyped-def]
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        try:
            await authenticate(key)
        except AuthError as exc:
            assert exc.code == "revoked_api_key"
            return time.monotonic() - started
        await asyncio.sleep(0.01)
    return None


def _check_revocation_crosses_instances(settings: AuthSettings) -> None:
    async def scenario() -> None:
        first, second = await open_auth(settings), await open_auth(settings)
        try:
            await first.admin.create_project("acme")
            record, key = await first.admin.create_key("acme", [Scope.INVOKE.value])
            await first.authenticator.authenticate(key)
            await second.authenticator.authenticate(key)  # now cached on the second
            await first.admin.revoke_key(record.key_id)
            elapsed = await _seconds_until_refused(second.authenticator.authenticate, key, 3.0)
            assert elapsed is not None and elapsed <= 1.0, elapsed
        finally:
            await first.close()
            await second.close()

    asyncio.run(scenario())


def test_revocation_on_one_instance_reaches_the_other_within_one_second(
        auth_settings: AuthSettings) -> None:
    """Two AuthServices on one store (Redis: two gateways; SQLite: a gateway and the CLI),
    with the default 0.5 s poll and a key cache far longer than that."""
    _check_revocation_crosses_instances(auth_settings.model_copy(
        update={"revocation_poll_interval_s": 0.5, "key_cache_ttl_s": 60.0}))


def test_redis_revocation_reaches_the_other_instance_with_a_one_second_poll(
        clean_redis_url: str, tmp_path: Path) -> None:
    _check_revocation_crosses_instances(AuthSettings(
        redis_url=clean_redis_url, data_dir=tmp_path, revocation_poll_interval_s=1.0,
        key_cache_ttl_s=60.0))


def test_a_revocation_is_pushed_to_the_change_feed_of_another_client(
        any_clean_redis_url: str) -> None:
    """The push path alone (the poll is the backup): on one server and on a Redis Cluster, where
    the PUBLISH goes to one node and the subscriber may sit on another."""
    from auth.keys import KeyRecord, ProjectRecord, new_key_id
    from auth.store_redis import RedisKeyStore, connect_redis

    async def scenario() -> None:
        listener = RedisKeyStore(connect_redis(any_clean_redis_url), owns_client=True)
        writer = RedisKeyStore(connect_redis(any_clean_redis_url), owns_client=True)
        feed = await listener.open_change_feed()
        assert feed is not None
        try:
            await writer.create_project(ProjectRecord("acme", 0.0))
            record = KeyRecord(new_key_id(), "acme", "ci", (Scope.INVOKE.value,), "h", 0.0)
            await writer.add_key(record)
            await writer.replace_key(record)
            received = [await feed.next_key_id(timeout_s=0.5) for _ in range(6)]
            assert record.key_id in received
        finally:
            await feed.aclose()
            await listener.close()
            await writer.close()

    asyncio.run(scenario())


class _NoCache:
    def invalidate(self, key_id: str | None = None) -> None:
        pass


async def _watch_for(store: object, seconds: float) -> None:
    """A RevocationWatcher on `store`, polling every 5 ms, for `seconds`."""
    from auth.revocation import RevocationWatcher

    watcher = RevocationWatcher(store, _NoCache(), 0.005)  # type: ignore[arg-type]
    await watcher.start()
    await asyncio.sleep(seconds)
    await watcher.stop()


def test_a_store_that_stays_down_is_one_log_line_per_stretch_not_a_traceback_per_poll(
        caplog: pytest.LogCaptureFixture) -> None:
    """Redis down: the watcher once logged a traceback from each loop every poll (two a second)."""
    import logging

    class DownStore:
        num_calls = 0

        async def revocation_version(self) -> int:
            self.num_calls += 1
            if self.num_calls == 1:
                return 0  # up at start
            if self.num_calls <= 30:
                raise ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
            return 0

        async def open_change_feed(self) -> None:
            raise ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    with caplog.at_level(logging.WARNING, logger="auth.revocation"):
        asyncio.run(_watch_for(DownStore(), 0.4))
    messages = [record.getMessage() for record in caplog.records]
    assert not any(record.exc_info for record in caplog.records)
    assert messages.count("revocation poll failed (1 in a row; retrying): ConnectionError: "
                          "Error 111 connecting to 127.0.0.1:6379. Connection refused.") == 1
    assert "revocation poll recovered after 29 failures" in messages
    assert len(messages) <= 6, messages  # the feed: its first failure and every 60th of ~80


def test_a_bug_in_the_poll_is_logged_with_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """A store that is down is one line without a traceback; anything else is a bug and keeps it."""
    import logging

    class BuggyStore:
        num_calls = 0

        async def revocation_version(self) -> int:
            self.num_calls += 1
            if self.num_calls == 1:
                return 0  # start() reads it
            raise TypeError("unsupported operand type(s) for +: 'int' and 'NoneType'")

        async def open_change_feed(self) -> None:
            return None

    with caplog.at_level(logging.WARNING, logger="auth.revocation"):
        asyncio.run(_watch_for(BuggyStore(), 0.05))
    [record] = [r for r in caplog.records if "revocation poll failed" in r.getMessage()]
    assert record.exc_info is not None and record.exc_info[0] is TypeError
