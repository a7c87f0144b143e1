"""First embedded start gets a default project and key; cache salts keep tenants apart."""

from __future__ import annotations

import asyncio
import stat

from auth import Principal, Scope, cache_salt_for, ensure_default_project, open_auth
from auth.settings import AuthSettings


def test_first_start_creates_default_project_and_key_once(auth_settings: AuthSettings) -> None:
    async def scenario() -> None:
        services = await open_auth(auth_settings)
        try:
            key = await ensure_default_project(services)
            assert key is not None
            path = auth_settings.default_key_path
            assert path.read_text().strip() == key
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            principal = await services.authenticator.authenticate(key)
            assert principal.project == "default"
            principal.require(Scope.INVOKE)
            principal.require(Scope.USAGE_READ)
            assert await ensure_default_project(services) is None
        finally:
            await services.close()

    asyncio.run(scenario())


def test_cache_salt_is_per_project_unless_sharing_is_chosen() -> None:
    a1 = Principal("a", "k1", frozenset())
    a2 = Principal("a", "k2", frozenset())
    b1 = Principal("b", "k3", frozenset())
    per_project = AuthSettings()
    assert cache_salt_for(a1, per_project) == cache_salt_for(a2, per_project)
    assert cache_salt_for(a1, per_project) != cache_salt_for(b1, per_project)
    per_key = AuthSettings(cache_salt_scope="key")
    assert cache_salt_for(a1, per_key) != cache_salt_for(a2, per_key)
    assert cache_salt_for(a1, AuthSettings(cache_salt_scope="shared")) is None
