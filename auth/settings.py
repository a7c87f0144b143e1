"""Auth settings: where credentials live and how bearer tokens are checked.

`AuthSettings` is nested into the gateway's pydantic-settings; `AuthSettings.from_env()` builds the
same thing from the plain `AIGW_*` variables for the CLI, so `aigw keys ...` acts on the data of a
gateway started with the same environment (AIGW_REDIS_URL set -> Redis, else SQLite under
AIGW_DATA_DIR).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator

# Asymmetric algorithms take keys from a JWKS; HS256 takes `jwt_hs256_secret`. `none` is never
# allowed.
SUPPORTED_JWT_ALGORITHMS = frozenset({"HS256", "RS256", "ES256"})


class AuthSettings(BaseModel):
    enabled: bool = True
    redis_url: str | None = None  # set -> keys live in Redis, shared by every gateway instance
    data_dir: Path = Path(".aigw")  # embedded store (SQLite) and the default key file
    # Secret mixed into every key hash (HMAC-SHA256). Unset: a generated one is kept in the store
    # itself (then a dump of the store alone could test guesses; set it to keep the two apart).
    key_pepper: str | None = None
    key_cache_ttl_s: float = Field(default=5.0, gt=0)  # verified keys cached in process
    revocation_poll_interval_s: float = Field(default=0.5, gt=0, le=1.0)

    jwt_hs256_secret: str | None = None
    jwt_jwks_file: Path | None = None
    jwt_jwks_url: str | None = None
    jwt_issuer: str | None = None
    jwt_audience: str | None = None
    # Explicit allow-list; None = the algorithms of the configured keys: HS256 with
    # `jwt_hs256_secret`, RS256 and ES256 with a JWKS (file or URL).
    jwt_algorithms: tuple[str, ...] | None = None
    jwt_leeway_s: float = Field(default=0.0, ge=0)
    # Verified tokens remembered in process (until min(key_cache_ttl_s, exp)), bounded in bytes
    # of token text: a token is as long as its issuer makes it (up to a header's 8 KiB).
    jwt_cache_max_bytes: int = Field(default=16 * 1024 * 1024, ge=0)

    # Prompt-cache salt: one per project (default), per key, or none (caching shared across
    # projects).
    cache_salt_scope: Literal["project", "key", "shared"] = "project"

    @field_validator("redis_url")
    @classmethod
    def _known_redis_scheme(cls, value: str | None) -> str | None:
        from infra.redis_client import check_redis_url

        return check_redis_url(value) if value else value  # unset or empty: no Redis

    @field_validator("jwt_algorithms")
    @classmethod
    def _only_known_algorithms(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is None:
            return None
        unknown = set(value) - SUPPORTED_JWT_ALGORITHMS
        if unknown:
            raise ValueError(f"unsupported JWT algorithms {sorted(unknown)}; allowed: "
                             f"{sorted(SUPPORTED_JWT_ALGORITHMS)} (never 'none')")
        return value

    @property
    def allowed_jwt_algorithms(self) -> frozenset[str]:
        """`jwt_algorithms`, or when unset the algorithms that have a key configured."""
        if self.jwt_algorithms is not None:
            return frozenset(self.jwt_algorithms)
        allowed = {"HS256"} if self.jwt_hs256_secret else set()
        if self.jwt_jwks_file is not None or self.jwt_jwks_url:
            allowed |= {"RS256", "ES256"}
        return frozenset(allowed)

    @property
    def sqlite_path(self) -> Path:
        return self.data_dir / "aigw.sqlite3"

    @property
    def default_key_path(self) -> Path:
        return self.data_dir / "default-key.txt"

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> AuthSettings:
        """AIGW_REDIS_URL, AIGW_DATA_DIR, AIGW_KEY_PEPPER, AIGW_JWT_* (the CLI's view of the store;
        AIGW_JWT_CACHE_MAX_BYTES too)."""
        env = os.environ if environ is None else environ
        fields: dict[str, object] = {}
        for name in ("redis_url", "data_dir", "key_pepper", "jwt_hs256_secret", "jwt_jwks_file",
                     "jwt_jwks_url", "jwt_issuer", "jwt_audience", "jwt_cache_max_bytes"):
            value = env.get(f"AIGW_{name.upper()}")
            if value:
                fields[name] = value
        algorithms = env.get("AIGW_JWT_ALGORITHMS")
        if algorithms:
            fields["jwt_algorithms"] = tuple(a.strip() for a in algorithms.split(",") if a.strip())
        return cls.model_validate(fields)
