"""Projects, API keys, scopes and JWTs: who is calling, and what they may do.

    services = await open_auth(settings)        # store + authenticator + revocation watcher
    principal = await services.authenticator.authenticate(credential)
    secret = await ensure_default_project(services)   # first embedded start only
    await services.close()

The gateway sees only the seam in auth/principal.py (Authenticator, Principal, Scope, AuthError);
auth/ has no HTTP: the admin API's routes are the gateway's (gateway/web/admin_routes.py).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from auth.bootstrap import ensure_default_project
from auth.cache_salt import cache_salt_for
from auth.principal import Authenticator, AuthError, Principal, Scope
from auth.settings import AuthSettings

if TYPE_CHECKING:
    from auth.key_admin import KeyAdmin
    from auth.revocation import RevocationWatcher
    from auth.store import KeyStore

__all__ = ["AuthError", "AuthServices", "AuthSettings", "Authenticator", "Principal", "Scope",
           "cache_salt_for", "ensure_default_project", "open_auth"]


@dataclass
class AuthServices:
    settings: AuthSettings
    store: KeyStore
    authenticator: Authenticator
    admin: KeyAdmin
    redis: Any | None  # redis.asyncio.Redis when settings.redis_url is set; share it with metering
    watcher: RevocationWatcher | None = None
    usage_reader: Any | None = field(default=None)  # the admin API's (gateway/web/admin_routes.py)

    def forget_cached_key(self, key_id: str) -> None:
        """After a revoke or rotate through this instance: its next use of `key_id` reads the
        store at once (other instances hear of it through their revocation watchers)."""
        from auth.authenticator import KeyAuthenticator

        if isinstance(self.authenticator, KeyAuthenticator):
            self.authenticator.invalidate(key_id)

    async def close(self) -> None:
        if self.watcher is not None:
            await self.watcher.stop()
        if self.usage_reader is not None and hasattr(self.usage_reader, "close"):
            await self.usage_reader.close()
        await self.store.close()
        if self.redis is not None:
            await self.redis.aclose()


async def open_auth(settings: AuthSettings) -> AuthServices:
    """Open the store (Redis when settings.redis_url, else SQLite under data_dir), resolve the
    pepper, and start the revocation watcher. Call `close()` on shutdown."""
    from auth.authenticator import AnonymousAuthenticator, KeyAuthenticator
    from auth.jwt_verifier import JwtVerifier
    from auth.key_admin import KeyAdmin
    from auth.revocation import RevocationWatcher
    from auth.store import open_key_store

    redis = None
    if settings.redis_url:
        from auth.store_redis import connect_redis

        redis = connect_redis(settings.redis_url)
    store = await open_key_store(settings, redis=redis)
    try:
        pepper = (settings.key_pepper.encode() if settings.key_pepper
                  else await store.load_or_create_pepper(secrets.token_bytes(32)))
        admin = KeyAdmin(store, pepper)
        if not settings.enabled:
            return AuthServices(settings, store, AnonymousAuthenticator(), admin, redis)
        authenticator = KeyAuthenticator(store, pepper, JwtVerifier(settings),
                                         settings.key_cache_ttl_s)
        watcher = RevocationWatcher(store, authenticator, settings.revocation_poll_interval_s)
        await watcher.start()
    except BaseException:
        await store.close()
        if redis is not None:
            await redis.aclose()
        raise
    return AuthServices(settings, store, authenticator, admin, redis, watcher)
