"""Key lifecycle on both stores: shown once, hashed at rest, listed, revoked, rotated, expired."""

from __future__ import annotations

import asyncio
import re
import sqlite3

import pytest

from auth import AuthError, AuthServices, Scope, open_auth
from auth.settings import AuthSettings
from infra.redis_client import connect_redis_sync, is_cluster_client

INVOKE = [Scope.INVOKE.value]


async def _with_project(settings: AuthSettings) -> AuthServices:
    services = await open_auth(settings)
    await services.admin.create_project("acme")
    return services


def _all_stored_bytes(settings: AuthSettings) -> bytes:
    """Every value the store holds, as one blob (to look for a secret in it)."""
    if settings.redis_url:
        client = connect_redis_sync(settings.redis_url)
        try:
            blob = b""
            every_node = {"target_nodes": "primaries"} if is_cluster_client(client) else {}
            for key in client.keys("*", **every_node):
                kind = client.type(key)
                if kind == b"string":
                    blob += client.get(key) or b""
                elif kind == b"hash":
                    blob += b"".join(k + v for k, v in client.hgetall(key).items())
                elif kind == b"set":
                    blob += b"".join(client.smembers(key))
            return blob
        finally:
            client.close()
    conn = sqlite3.connect(settings.sqlite_path)
    try:
        conn.execute("PRAGMA wal_checkpoint(FULL)")
        return "".join(repr(row) for table in ("projects", "api_keys", "auth_meta")
                       for row in conn.execute(f"SELECT * FROM {table}")).encode()
    finally:
        conn.close()


def test_created_key_authenticates_and_is_stored_only_as_a_hash(
        auth_settings: AuthSettings) -> None:
    async def scenario() -> None:
        services = await _with_project(auth_settings)
        try:
            record, key = await services.admin.create_key("acme", INVOKE, name="ci",
                                                          allowed_models=["m1"])
            assert re.fullmatch(rf"sk-aigw-{record.key_id}-[A-Za-z0-9_-]{{43}}", key)
            principal = await services.authenticator.authenticate(key)
            assert (principal.project, principal.key_id) == ("acme", record.key_id)
            assert principal.scopes == frozenset(INVOKE)
            principal.require(Scope.INVOKE)
            with pytest.raises(AuthError) as refused:
                principal.require_model("m2")
            assert refused.value.status == 403
            secret = key.rsplit("-", 1)[-1] if key.count("-") == 3 else key.split("-", 3)[3]
            stored = _all_stored_bytes(auth_settings)
            assert record.key_id.encode() in stored  # the store really was read
            assert secret.encode() not in stored and key.encode() not in stored
            listed = await services.store.list_keys("acme")
            assert [k.key_id for k in listed] == [record.key_id]
            assert "secret_hash" not in listed[0].public_view()
        finally:
            await services.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("credential",
                         [None, "", "sk-aigw-nope", "Bearer x", "sk-aigw-0123456789ab-x"])
def test_missing_or_malformed_credentials_are_refused_with_401(
        auth_settings: AuthSettings, credential: str | None) -> None:
    async def scenario() -> None:
        services = await _with_project(auth_settings)
        try:
            with pytest.raises(AuthError) as refused:
                await services.authenticator.authenticate(credential)
            assert refused.value.status == 401
        finally:
            await services.close()

    asyncio.run(scenario())


def test_a_wrong_secret_for_a_real_key_id_is_refused(auth_settings: AuthSettings) -> None:
    async def scenario() -> None:
        services = await _with_project(auth_settings)
        try:
            record, key = await services.admin.create_key("acme", INVOKE)
            await services.authenticator.authenticate(key)  # warm the cache
            await services.authenticator.authenticate(key)  # ... and its verified secret
            for secret in ("A" * 43, key.rsplit("-", 1)[1][:-1] + "é"):  # non-ASCII too
                forged = f"sk-aigw-{record.key_id}-{secret}"
                with pytest.raises(AuthError) as refused:
                    await services.authenticator.authenticate(forged)
                assert (refused.value.status, refused.value.code) == (401, "invalid_api_key")
            assert (await services.authenticator.authenticate(key)).key_id == record.key_id
        finally:
            await services.close()

    asyncio.run(scenario())


def test_a_revoked_key_is_refused_on_the_same_instance(auth_settings: AuthSettings) -> None:
    async def scenario() -> None:
        services = await _with_project(auth_settings)
        try:
            record, key = await services.admin.create_key("acme", INVOKE)
            await services.authenticator.authenticate(key)
            await services.admin.revoke_key(record.key_id)
            for _ in range(100):  # bounded: the watcher polls every 0.1 s here
                try:
                    await services.authenticator.authenticate(key)
                except AuthError as exc:
                    assert (exc.status, exc.code) == (401, "revoked_api_key")
                    break
                await asyncio.sleep(0.02)
            else:
                pytest.fail("revoked key still accepted after 2 s")
            listed = await services.store.list_keys("acme")
            assert listed[0].revoked_at is not None
        finally:
            await services.close()

    asyncio.run(scenario())


def test_rotation_keeps_the_old_secret_only_for_its_grace_period(
        auth_settings: AuthSettings) -> None:
    async def scenario() -> None:
        services = await _with_project(auth_settings)
        try:
            record, old_key = await services.admin.create_key("acme", INVOKE)
            rotated, new_key = await services.admin.rotate_key(record.key_id, grace_s=3600)
            assert rotated.key_id == record.key_id and new_key != old_key
            services.authenticator.invalidate()  # type: ignore[attr-defined]
            assert (await services.authenticator.authenticate(new_key)).key_id == record.key_id
            assert (await services.authenticator.authenticate(old_key)).key_id == record.key_id
            _, newest_key = await services.admin.rotate_key(record.key_id, grace_s=0)
            services.authenticator.invalidate()  # type: ignore[attr-defined]
            await services.authenticator.authenticate(newest_key)
            for stale in (old_key, new_key):
                with pytest.raises(AuthError) as refused:
                    await services.authenticator.authenticate(stale)
                assert refused.value.status == 401
        finally:
            await services.close()

    asyncio.run(scenario())


def test_an_expired_key_is_refused(auth_settings: AuthSettings) -> None:
    async def scenario() -> None:
        services = await _with_project(auth_settings)
        try:
            _, key = await services.admin.create_key("acme", INVOKE, expires_in_s=0.2)
            await services.authenticator.authenticate(key)
            await asyncio.sleep(0.25)
            with pytest.raises(AuthError) as refused:
                await services.authenticator.authenticate(key)
            assert (refused.value.status, refused.value.code) == (401, "expired_api_key")
        finally:
            await services.close()

    asyncio.run(scenario())


def test_a_key_without_invoke_scope_gets_403(auth_settings: AuthSettings) -> None:
    async def scenario() -> None:
        services = await _with_project(auth_settings)
        try:
            _, key = await services.admin.create_key("acme", [Scope.USAGE_READ.value])
            principal = await services.authenticator.authenticate(key)
            with pytest.raises(AuthError) as refused:
                principal.require(Scope.INVOKE)
            assert refused.value.status == 403
        finally:
            await services.close()

    asyncio.run(scenario())


def test_keys_survive_a_restart_of_the_store(auth_settings: AuthSettings) -> None:
    async def scenario() -> None:
        services = await _with_project(auth_settings)
        _, key = await services.admin.create_key("acme", INVOKE)
        await services.close()
        reopened = await open_auth(auth_settings)
        try:
            assert (await reopened.authenticator.authenticate(key)).project == "acme"
            assert [p.name for p in await reopened.store.list_projects()] == ["acme"]
        finally:
            await reopened.close()

    asyncio.run(scenario())


class _CountingStore:
    """Wraps a KeyStore and counts get_key calls."""

    def __init__(self, inner: object) -> None:
        self._inner = inner
        self.num_get_key = 0

    async def get_key(self, key_id: str) -> object:
        self.num_get_key += 1
        return await self._inner.get_key(key_id)  # type: ignore[attr-defined]


def test_garbage_credentials_do_not_reach_the_store_on_every_request(
        auth_settings: AuthSettings) -> None:
    from auth.authenticator import KeyAuthenticator

    async def scenario() -> None:
        services = await _with_project(auth_settings)
        try:
            record, key = await services.admin.create_key("acme", INVOKE)
            store = _CountingStore(services.store)
            authenticator = KeyAuthenticator(store, services.admin._pepper, None, 60.0)  # type: ignore[arg-type]
            for credential in [f"sk-aigw-{'f' * 12}-{'x' * 43}"] * 5 + \
                    [f"sk-aigw-{record.key_id}-{'x' * 43}"] * 5:
                with pytest.raises(AuthError):
                    await authenticator.authenticate(credential)
            assert store.num_get_key == 2  # one per key id, then remembered
            assert (await authenticator.authenticate(key)).key_id == record.key_id
            assert store.num_get_key == 2
        finally:
            await services.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("name", ["acme\n", ".hidden", "-x", "a" * 65, "été", ""])
def test_a_project_name_outside_the_documented_alphabet_is_refused(name: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """"acme\\n" once passed: the pattern ended in `$`, which also matches before a final
    newline."""
    from auth.key_admin import InvalidRequest

    async def scenario() -> None:
        services = await open_auth(AuthSettings(data_dir=tmp_path / "data", enabled=False))
        try:
            with pytest.raises(InvalidRequest, match="starting with a letter or digit"):
                await services.admin.create_project(name)
            assert await services.store.list_projects() == []
        finally:
            await services.close()

    asyncio.run(scenario())
