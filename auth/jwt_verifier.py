"""Bearer JWTs, verified with pyjwt.

HS256 uses `jwt_hs256_secret`; RS256/ES256 use keys from a JWKS file or URL (PyJWKClient, fetched
off the event loop). The header's `alg` must be in the allow-list (`AIGW_JWT_ALGORITHMS`; unset:
the algorithms that have a key configured) and picks the key *kind*: an HS*
token is only ever checked against the HMAC secret, an RS*/ES* token only against a JWKS key of
that algorithm, so a token HMAC-signed with an RSA public key as secret fails (no HS/RS confusion),
and `none` is never accepted. exp is required; nbf is checked when present; iss/aud when configured;
exp, nbf and iat must be NumericDates (JSON numbers, not strings or booleans: RFC 7519).
Scopes come from the space-separated `scope` claim, the project from the `project` claim.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any

import jwt

from auth.principal import AuthError, Principal, is_project_name
from auth.settings import AuthSettings
from infra.byte_lru import ByteLRU, str_bytes

_MAX_CACHED_TOKEN_BYTES = 64 * 1024
_PRINCIPAL_BYTES = 1_024  # a Principal, its scope set and the entry's tuple, about


class JwtVerifier:
    def __init__(self, settings: AuthSettings) -> None:
        self._settings = settings
        self._allowed = settings.allowed_jwt_algorithms
        self._jwks: dict[str, jwt.PyJWK] = {}
        self._jwks_list: list[jwt.PyJWK] = []
        if settings.jwt_jwks_file is not None:
            jwk_set = jwt.PyJWKSet.from_dict(json.loads(settings.jwt_jwks_file.read_text()))
            self._jwks_list = list(jwk_set.keys)
            self._jwks = {k.key_id: k for k in jwk_set.keys if k.key_id}
        # Verified tokens: token -> (caller, monotonic time until which the answer holds).
        self._verified: ByteLRU[str, tuple[Principal, float]] = ByteLRU(
            settings.jwt_cache_max_bytes, max_entry_bytes=_MAX_CACHED_TOKEN_BYTES)
        self._jwks_client = (jwt.PyJWKClient(settings.jwt_jwks_url, cache_keys=True, lifespan=300)
                             if settings.jwt_jwks_url else None)

    @property
    def configured(self) -> bool:
        return bool(self._settings.jwt_hs256_secret or self._jwks_list or self._jwks_client)

    async def verify(self, token: str) -> Principal:
        """The caller named by a valid token; AuthError(401) for any invalid one."""
        if not token.isascii():  # a header byte that is not UTF-8 (a lone surrogate)
            raise _invalid("malformed token")
        cached = self._verified.get(token)
        if cached is not None and time.monotonic() < cached[1]:
            return cached[0]
        principal, exp = await self._verify_uncached(token)
        ttl_s = min(self._settings.key_cache_ttl_s, exp - time.time())
        self._verified.put(token, (principal, time.monotonic() + ttl_s),
                           str_bytes(token) + _PRINCIPAL_BYTES)
        return principal

    async def _verify_uncached(self, token: str) -> tuple[Principal, float]:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError as exc:
            raise _invalid(f"malformed token: {exc}") from exc
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in self._allowed:
            raise _invalid(f"token algorithm {alg!r} is not allowed")
        key = await self._key_for(alg, header.get("kid"), token)
        settings = self._settings
        try:
            claims: dict[str, Any] = jwt.decode(
                token, key=key, algorithms=[alg], audience=settings.jwt_audience,
                issuer=settings.jwt_issuer, leeway=settings.jwt_leeway_s,
                options={"require": ["exp", "sub"],
                         "verify_aud": settings.jwt_audience is not None})
        except jwt.ExpiredSignatureError as exc:
            raise AuthError(401, "expired_token", "the token has expired") from exc
        except jwt.PyJWTError as exc:
            raise _invalid(str(exc)) from exc
        for claim in _NUMERIC_DATE_CLAIMS:
            if claim in claims and not _is_numeric_date(claims[claim]):
                raise _invalid(f"the {claim!r} claim must be a NumericDate (a number of seconds)")
        project = claims.get("project")
        if not isinstance(project, str) or not project:
            raise _invalid("the token has no 'project' claim")
        if not is_project_name(project):  # (a ':' made stored responses' keys collide)
            raise _invalid("the token's 'project' claim is not a project name: 1-64 letters, "
                           "digits and '_.-', starting with a letter or digit")
        scope_claim = claims.get("scope", "")
        scopes = frozenset(scope_claim.split()) if isinstance(scope_claim, str) else frozenset()
        principal = Principal(project=project, key_id=f"jwt:{claims['sub']}", scopes=scopes,
                              via="jwt")
        return principal, float(claims["exp"])

    async def _key_for(self, alg: str, kid: object, token: str) -> Any:
        if alg.startswith("HS"):
            if not self._settings.jwt_hs256_secret:
                raise _invalid("HMAC tokens are not accepted here")
            return self._settings.jwt_hs256_secret
        if self._jwks_list:
            candidates = ([self._jwks[kid]] if isinstance(kid, str) and kid in self._jwks
                          else self._jwks_list)
            for jwk in candidates:
                if jwk.algorithm_name == alg and _key_kind(jwk.key_type) == alg[:2]:
                    return jwk.key
        if self._jwks_client is not None:
            try:
                jwk = await asyncio.to_thread(self._jwks_client.get_signing_key_from_jwt, token)
            except jwt.PyJWTError as exc:
                raise _invalid(f"no signing key: {exc}") from exc
            if jwk.algorithm_name == alg and _key_kind(jwk.key_type) == alg[:2]:
                return jwk.key
        raise _invalid(f"no {alg} key to verify this token")


_NUMERIC_DATE_CLAIMS = ("exp", "nbf", "iat")


def _is_numeric_date(value: object) -> bool:
    """RFC 7519 NumericDate: a JSON number of seconds (pyjwt takes "9999999999" and true through
    int(), and Python's json reads Infinity and NaN), finite."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond a double
        return False


def _key_kind(kty: str | None) -> str:
    return {"RSA": "RS", "EC": "ES"}.get(kty or "", "")


def _invalid(message: str) -> AuthError:
    return AuthError(401, "invalid_token", message)
