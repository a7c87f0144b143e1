"""Where projects and key records live: the `KeyStore` contract and its errors.

Two implementations: `RedisKeyStore` (auth/store_redis.py, shared by every gateway instance) and
`SqliteKeyStore` (auth/store_sqlite.py, the embedded store under data_dir). Both are opened by
`open_key_store(settings)`. Keys are found by key id, never by scanning.

Every change that can take access away (revoke, rotate) bumps a store-wide *revocation version*;
instances poll it (and Redis also publishes the key id) to drop cached keys within a second.

    StoreError
    ├── ProjectExists   create_project on a taken name
    ├── UnknownProject  a key for a project that does not exist
    └── UnknownKey      revoke/rotate of a key id that does not exist
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from auth.keys import KeyRecord, ProjectRecord
from auth.settings import AuthSettings
from infra.redis_watch import ChangeFeed


class StoreError(Exception):
    pass


class ProjectExists(StoreError):
    pass


class UnknownProject(StoreError):
    pass


class UnknownKey(StoreError):
    pass


class KeyStore(ABC):
    @abstractmethod
    async def create_project(self, project: ProjectRecord) -> None:
        """Add a project; raises ProjectExists when the name is taken."""

    @abstractmethod
    async def get_project(self, name: str) -> ProjectRecord | None: ...

    @abstractmethod
    async def list_projects(self) -> list[ProjectRecord]:
        """All projects, sorted by name."""

    @abstractmethod
    async def add_key(self, record: KeyRecord) -> None:
        """Store a new key record (its project must exist: the caller checks)."""

    @abstractmethod
    async def get_key(self, key_id: str) -> KeyRecord | None: ...

    @abstractmethod
    async def list_keys(self, project: str) -> list[KeyRecord]:
        """The project's keys, oldest first."""

    @abstractmethod
    async def replace_key(self, record: KeyRecord) -> None:
        """Overwrite an existing record (revoke, rotate), then bump the revocation version and
        notify other instances. Raises UnknownKey when the key id is not stored."""

    @abstractmethod
    async def revocation_version(self) -> int:
        """A counter that grows on every replace_key; 0 before the first."""

    @abstractmethod
    async def load_or_create_pepper(self, candidate: bytes) -> bytes:
        """The pepper every instance shares: the stored one, or `candidate` stored first."""

    async def open_change_feed(self) -> ChangeFeed | None:
        """A push feed of changed key ids, where the backend has one (Redis pub/sub)."""
        return None

    @abstractmethod
    async def close(self) -> None: ...


async def open_key_store(settings: AuthSettings, redis: object | None = None) -> KeyStore:
    """Redis when settings.redis_url is set (reusing `redis` when given), else SQLite."""
    if settings.redis_url:
        from auth.store_redis import RedisKeyStore, connect_redis

        client = redis if redis is not None else connect_redis(settings.redis_url)
        return RedisKeyStore(client, owns_client=redis is None)
    from auth.store_sqlite import SqliteKeyStore

    return await SqliteKeyStore.open(settings.sqlite_path)
