"""The `Authenticator` the gateway calls on every request: API keys and bearer JWTs.

API keys are looked up by key id and their records cached in process for `key_cache_ttl_s`, so the
hot path is one HMAC and one constant-time compare; once a secret has matched the cached record's
current hash, the entry remembers it and later requests with that secret compare it in constant
time instead of re-computing the HMAC (state checks, revocation and expiry still run on every
request; a rotated or re-read record starts without a remembered secret). The cache is emptied by
the revocation watcher (auth/revocation.py) within a second of any revoke/rotate on any instance. A
presented secret is checked before the key's state, so a stranger learns nothing about whether a key
id is revoked.

Store reads are bounded per key id, so garbage credentials cannot turn into a store load:
    unknown key id            remembered as unknown for `key_cache_ttl_s` (key ids are random and
                              unguessable before creation, so no real key is ever hidden by this)
    secret does not match     the record is re-read at most once per `_REFRESH_AFTER_MISMATCH_S`
                              (a rotation on another instance that the watcher has not yet seen)
"""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass, field

from auth.jwt_verifier import JwtVerifier
from auth.keys import KeyRecord, ParsedKey, hash_secret, parse_key
from auth.principal import ANONYMOUS, AuthError, Principal
from auth.store import KeyStore

_MAX_CACHED_KEYS = 100_000
_REFRESH_AFTER_MISMATCH_S = 1.0


@dataclass
class _CachedKey:
    record: KeyRecord
    principal: Principal
    fetched_at: float  # monotonic seconds
    verified_secret: str | None = field(default=None, repr=False)  # matched record.secret_hash


class KeyAuthenticator:
    def __init__(self, store: KeyStore, pepper: bytes, jwt_verifier: JwtVerifier | None,
                 cache_ttl_s: float) -> None:
        self._store = store
        self._pepper = pepper
        self._jwt = jwt_verifier if jwt_verifier is not None and jwt_verifier.configured else None
        self._cache_ttl_s = cache_ttl_s
        self._cache: dict[str, _CachedKey] = {}
        self._unknown: dict[str, float] = {}  # key id -> monotonic time it was found missing

    async def authenticate(self, credential: str | None) -> Principal:
        """The caller, or AuthError(401) for a missing/invalid/revoked/expired credential."""
        if not credential:
            raise AuthError(401, "missing_credential",
                            "no API key was given: send it as 'Authorization: Bearer <key>' "
                            "(what the OpenAI SDKs send) or as 'x-api-key: <key>' (what the "
                            "Anthropic SDKs send)")
        if not is_printable_ascii(credential):  # keys and JWTs are ASCII by construction; a
            # header byte that is not UTF-8 arrives as a lone surrogate no store can encode
            raise AuthError(401, "invalid_api_key", "the credential is not valid")
        parsed = parse_key(credential)
        if parsed is not None:
            return await self._authenticate_key(parsed)
        if self._jwt is not None and credential.count(".") == 2:
            return await self._jwt.verify(credential)
        raise AuthError(401, "invalid_api_key", "the API key is not valid")

    async def current_principal(self, key_id: str) -> Principal:
        """An API key's rights now, by its id alone, for work it started earlier (a batch's
        lines run long after the request that created them): AuthError(401) once the key is
        revoked, expired or deleted, seen as soon as a request would see it (the cache's TTL,
        emptied by the revocation watcher)."""
        cached = self._cache.get(key_id)
        if cached is None or time.monotonic() - cached.fetched_at > self._cache_ttl_s:
            cached = await self._fetch(key_id)
        return self._check_state(cached, time.time())

    def invalidate(self, key_id: str | None = None) -> None:
        """Forget one cached key (or all of them): the next use reads the store."""
        if key_id is None:
            self._cache.clear()
        else:
            self._cache.pop(key_id, None)
        self._unknown.clear()

    async def _authenticate_key(self, parsed: ParsedKey) -> Principal:
        cached = self._cache.get(parsed.key_id)
        if cached is None or time.monotonic() - cached.fetched_at > self._cache_ttl_s:
            cached = await self._fetch(parsed.key_id)
        now = time.time()
        verified = cached.verified_secret
        if verified is not None and parsed.secret.isascii() and hmac.compare_digest(
                verified, parsed.secret):
            return self._check_state(cached, now)
        presented = hash_secret(self._pepper, parsed.key_id, parsed.secret)
        if hmac.compare_digest(presented, cached.record.secret_hash):
            cached.verified_secret = parsed.secret
        elif not cached.record.matches(presented, now):
            if time.monotonic() - cached.fetched_at < _REFRESH_AFTER_MISMATCH_S:
                raise AuthError(401, "invalid_api_key", "the API key is not valid")
            cached = await self._fetch(parsed.key_id)
            if not cached.record.matches(presented, now):
                raise AuthError(401, "invalid_api_key", "the API key is not valid")
        return self._check_state(cached, now)

    @staticmethod
    def _check_state(cached: _CachedKey, now: float) -> Principal:
        if cached.record.revoked_at is not None:
            raise AuthError(401, "revoked_api_key", "the API key has been revoked")
        if cached.record.is_expired(now):
            raise AuthError(401, "expired_api_key", "the API key has expired")
        return cached.principal

    async def _fetch(self, key_id: str) -> _CachedKey:
        missing_since = self._unknown.get(key_id)
        if missing_since is not None and time.monotonic() - missing_since < self._cache_ttl_s:
            raise AuthError(401, "invalid_api_key", "the API key is not valid")
        record = await self._store.get_key(key_id)
        if record is None:
            if len(self._unknown) >= _MAX_CACHED_KEYS:
                self._unknown.clear()
            self._unknown[key_id] = time.monotonic()
            raise AuthError(401, "invalid_api_key", "the API key is not valid")
        principal = Principal(
            project=record.project, key_id=record.key_id, scopes=frozenset(record.scopes),
            allowed_models=(None if record.allowed_models is None
                            else frozenset(record.allowed_models)),
            via="api_key")
        if len(self._cache) >= _MAX_CACHED_KEYS:
            self._cache.clear()
        entry = _CachedKey(record, principal, time.monotonic())
        self._cache[key_id] = entry
        return entry


def is_printable_ascii(text: str) -> bool:
    """Only the 95 printable ASCII characters (no controls, no space inside a token)."""
    return text.isascii() and text.isprintable() and " " not in text


class AnonymousAuthenticator:
    """Auth turned off: every caller is `ANONYMOUS` (auth/principal.py), whatever it sends."""

    async def authenticate(self, credential: str | None) -> Principal:
        return ANONYMOUS
