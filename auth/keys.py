"""API keys: the secret's format, its hash at rest, and the stored record.

A key reads `sk-aigw-<key_id>-<secret>`:
    key_id  12 hex chars, public and stable (survives rotation); stores look keys up by it, never
            scan
    secret  secrets.token_urlsafe(32): 256 random bits, shown once, never stored

At rest we keep HMAC-SHA256(pepper, "<key_id>:<secret>"). A slow KDF (bcrypt, argon2) protects
low-entropy passwords from guessing; a 256-bit random secret cannot be guessed, so a fast hash is as
safe and keeps authentication in microseconds. The pepper (a server secret kept apart from the
store) means a leaked store alone cannot even test a guess; binding the key id into the MAC stops a
hash from being copied onto another key's record. Hashes are compared with hmac.compare_digest.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import asdict, dataclass, replace
from typing import Any

KEY_PREFIX = "sk-aigw-"
_KEY_ID_HEX_CHARS = 12
_KEY_ID = re.compile(r"[0-9a-f]+")
_SECRET = re.compile(r"[A-Za-z0-9_-]+")  # secrets.token_urlsafe's alphabet


@dataclass(frozen=True)
class ParsedKey:
    key_id: str
    secret: str


def new_key_id() -> str:
    return secrets.token_hex(_KEY_ID_HEX_CHARS // 2)


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def format_key(key_id: str, secret: str) -> str:
    return f"{KEY_PREFIX}{key_id}-{secret}"


def parse_key(credential: str) -> ParsedKey | None:
    """Split a presented key; None when it is not shaped like one of ours (a key id of 12
    lowercase hex digits, a secret of at most 128 URL-safe base64 characters)."""
    if not credential.startswith(KEY_PREFIX):
        return None
    key_id, sep, secret = credential[len(KEY_PREFIX):].partition("-")
    if (not sep or not is_key_id(key_id) or not secret or len(secret) > 128
            or not _SECRET.fullmatch(secret)):
        return None
    return ParsedKey(key_id, secret)


def key_id_of(text: str) -> str:
    """The key id `text` names: itself, or for a whole key `sk-aigw-<key_id>-<secret>` pasted
    where its id belongs, that id (so an answer naming it never echoes the secret)."""
    return text[len(KEY_PREFIX):].partition("-")[0] if text.startswith(KEY_PREFIX) else text


def is_key_id(text: str) -> bool:
    """Shaped like a key id (what `new_key_id` makes): stores are only ever asked for these."""
    return len(text) == _KEY_ID_HEX_CHARS and _KEY_ID.fullmatch(text) is not None


def hash_secret(pepper: bytes, key_id: str, secret: str) -> str:
    return hmac.digest(pepper, f"{key_id}:{secret}".encode(), hashlib.sha256).hex()


@dataclass(frozen=True)
class ProjectRecord:
    name: str
    created_at: float


@dataclass(frozen=True)
class KeyRecord:
    """One API key as stored: everything but the secret. Times are unix seconds."""

    key_id: str
    project: str
    name: str
    scopes: tuple[str, ...]
    secret_hash: str
    created_at: float
    allowed_models: tuple[str, ...] | None = None  # None = every model
    expires_at: float | None = None
    revoked_at: float | None = None
    # After a rotation the previous secret keeps working until previous_valid_until.
    previous_hash: str | None = None
    previous_valid_until: float | None = None

    def matches(self, presented_hash: str, now: float) -> bool:
        """True when the presented hash is the current secret's, or the previous one's in grace."""
        if hmac.compare_digest(presented_hash, self.secret_hash):
            return True
        return (self.previous_hash is not None and self.previous_valid_until is not None
                and now < self.previous_valid_until
                and hmac.compare_digest(presented_hash, self.previous_hash))

    def is_expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    def rotated(self, new_hash: str, now: float, grace_s: float) -> KeyRecord:
        return replace(self, secret_hash=new_hash, previous_hash=self.secret_hash,
                       previous_valid_until=now + grace_s)

    def public_view(self) -> dict[str, Any]:
        """The record as the admin API and CLI show it: no hashes."""
        view = asdict(self)
        for field_name in ("secret_hash", "previous_hash"):
            view.pop(field_name)
        view["scopes"] = list(self.scopes)
        view["allowed_models"] = None if self.allowed_models is None else list(self.allowed_models)
        return view

    def to_json_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> KeyRecord:
        models = data.get("allowed_models")
        return cls(**{**data, "scopes": tuple(data["scopes"]),
                      "allowed_models": None if models is None else tuple(models)})
