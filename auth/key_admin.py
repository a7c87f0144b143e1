"""Managing projects and keys: create (the secret is returned once), list, revoke, rotate.

Used by the admin HTTP API, the CLI and the first-start bootstrap. Secrets leave this module only as
the return value of create_key/rotate_key; only their HMAC is handed to the store.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

from auth.keys import (
    KeyRecord,
    ProjectRecord,
    format_key,
    hash_secret,
    is_key_id,
    key_id_of,
    new_key_id,
    new_secret,
)
from auth.principal import Scope, is_project_name
from auth.store import KeyStore, UnknownKey, UnknownProject

_VALID_SCOPES = frozenset(s.value for s in Scope)


MAX_DURATION_S = 100 * 365 * 86_400  # an expiry or a grace period: at most about a century


class InvalidRequest(ValueError):
    """A name, scope or duration that the admin API answers with 400."""


def checked_seconds(value: object, what: str, *, positive: bool) -> float:
    """`value` as a number of seconds in (0 or [0, MAX_DURATION_S]; InvalidRequest otherwise
    (a bool, a string, NaN, an int too large for a float)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"{what} must be a number of seconds")
    try:
        seconds = float(value)
    except OverflowError:
        seconds = math.inf
    if not (math.isfinite(seconds) and (seconds > 0 if positive else seconds >= 0)
            and seconds <= MAX_DURATION_S):
        raise InvalidRequest(f"{what} must be a number of seconds {'>' if positive else '>='} 0 "
                             f"and at most {MAX_DURATION_S}")
    return seconds


class KeyAdmin:
    def __init__(self, store: KeyStore, pepper: bytes) -> None:
        self.store = store
        self._pepper = pepper

    async def create_project(self, name: str) -> ProjectRecord:
        if not is_project_name(name):
            raise InvalidRequest(f"invalid project name {name!r}: 1-64 letters, digits and '_.-', "
                                 "starting with a letter or digit")
        project = ProjectRecord(name=name, created_at=time.time())
        await self.store.create_project(project)
        return project

    async def create_key(self, project: str, scopes: list[str], name: str = "",
                         allowed_models: list[str] | None = None,
                         expires_in_s: float | None = None) -> tuple[KeyRecord, str]:
        """A new key of `project`: (its record, the full key string, shown once)."""
        unknown = set(scopes) - _VALID_SCOPES
        if not scopes or unknown:
            raise InvalidRequest(f"scopes must be a non-empty subset of {sorted(_VALID_SCOPES)}")
        if expires_in_s is not None:
            expires_in_s = checked_seconds(expires_in_s, "expires_in", positive=True)
        if allowed_models is not None and not allowed_models:  # [] must not mean "every model"
            raise InvalidRequest("models must name at least one model (omit it for every model)")
        if allowed_models is not None and not all(
                isinstance(model, str) and model.strip() for model in allowed_models):
            # (`--model "$MODEL"` with MODEL unset: a key that can call nothing)
            raise InvalidRequest("models must be model names, not empty")
        if await self.store.get_project(project) is None:
            raise UnknownProject(project)
        now = time.time()
        key_id, secret = new_key_id(), new_secret()
        record = KeyRecord(
            key_id=key_id, project=project, name=name, scopes=tuple(dict.fromkeys(scopes)),
            secret_hash=hash_secret(self._pepper, key_id, secret), created_at=now,
            allowed_models=None if not allowed_models else tuple(allowed_models),
            expires_at=None if expires_in_s is None else now + expires_in_s)
        await self.store.add_key(record)
        return record, format_key(key_id, secret)

    async def get_key(self, key_id: str) -> KeyRecord:
        """The key of this id; a whole key given instead stands for its id (key_id_of), and
        UnknownKey names only the id (at most 64 characters of what was given)."""
        key_id = key_id_of(key_id)
        record = await self.store.get_key(key_id) if is_key_id(key_id) else None
        if record is None:
            raise UnknownKey(key_id[:64])
        return record

    async def revoke_key(self, key_id: str) -> KeyRecord:
        record = await self.get_key(key_id)
        if record.revoked_at is not None:
            return record
        revoked = replace(record, revoked_at=time.time())
        await self.store.replace_key(revoked)
        return revoked

    async def rotate_key(self, key_id: str, grace_s: float) -> tuple[KeyRecord, str]:
        """A new secret for the same key id; the old one keeps working for grace_s seconds."""
        grace_s = checked_seconds(grace_s, "grace_seconds", positive=False)
        record = await self.get_key(key_id)
        key_id = record.key_id
        if record.revoked_at is not None:
            raise InvalidRequest(f"key {key_id} is revoked")
        secret = new_secret()
        rotated = record.rotated(hash_secret(self._pepper, key_id, secret), time.time(), grace_s)
        await self.store.replace_key(rotated)
        return rotated, format_key(key_id, secret)
