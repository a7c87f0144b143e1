"""Limits set at run time (admin API, `aigw limits`): where they live, and how every gateway hears.

    store = await open_limit_store(redis=services.redis, data_dir=settings.data_dir)
    await store.put(LimitScope("acme"), Limits(requests_per_minute=60))      # a project
    await store.put(LimitScope("acme", key_id="k_..."), Limits(...))         # one of its keys
    stored = await store.load()  # StoredLimits: every record, for BaseMeter.set_stored_limits

A stored record replaces the config file's limits of its scope (all of them: a field it leaves
unset is no limit); deleting it brings the config's back. Every change bumps a store-wide
*limits version* and, on Redis, is published: gateway/metering/limit_watcher.py reloads on
either, as auth/revocation.py does for keys, so a change is in force everywhere within a second.

Redis (shared by every instance):
    aigw:limits:records    hash    "project:<P>" | "key:<key_id>" -> {"project", "key_id", "limits"}
    aigw:limits:version    int     INCR on every change (polled)
    aigw:limits:changes    pubsub  message = the changed field
SQLite (<data_dir>/aigw.sqlite3, the embedded store):
    limit_records(scope PRIMARY KEY, project, record JSON), limit_meta(name, value) with `version`
Records are loaded whole on a change: their number is one per limited project or key.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from gateway.metering.settings import Limits
from infra.redis_watch import ChangeFeed, open_pubsub_feed

log = logging.getLogger("aigw.metering")
RECORDS_KEY = "aigw:limits:records"
VERSION_KEY = "aigw:limits:version"
CHANGES_CHANNEL = "aigw:limits:changes"
SQLITE_FILE_NAME = "aigw.sqlite3"  # shared with auth and the embedded meter


@dataclass(frozen=True)
class LimitScope:
    """A project, or one key of it (`key_id` set)."""

    project: str
    key_id: str | None = None

    @property
    def field(self) -> str:
        return f"project:{self.project}" if self.key_id is None else f"key:{self.key_id}"


@dataclass(frozen=True)
class StoredLimits:
    projects: Mapping[str, Limits] = field(default_factory=dict)  # project -> its limits
    keys: Mapping[str, Limits] = field(default_factory=dict)  # key id -> its limits
    key_projects: Mapping[str, str] = field(default_factory=dict)  # key id -> its project

    def get(self, scope: LimitScope) -> Limits | None:
        if scope.key_id is None:
            return self.projects.get(scope.project)
        return self.keys.get(scope.key_id)

    def of_project(self, project: str) -> dict[str, Limits]:
        """The project's stored key limits, by key id."""
        return {k: v for k, v in self.keys.items() if self.key_projects.get(k) == project}


def _encode(scope: LimitScope, limits: Limits) -> str:
    return json.dumps({"project": scope.project, "key_id": scope.key_id,
                       "limits": limits.model_dump(mode="json", exclude_defaults=True)})


def _decode(records: list[str]) -> StoredLimits:
    projects: dict[str, Limits] = {}
    keys: dict[str, Limits] = {}
    key_projects: dict[str, str] = {}
    for raw in records:
        try:
            data = json.loads(raw)
            limits = Limits.model_validate(data["limits"])
        except (ValueError, KeyError, TypeError, ValidationError):
            log.exception("a stored limits record does not parse; ignored: %.200s", raw)
            continue
        if data.get("key_id") is None:
            projects[str(data["project"])] = limits
        else:
            keys[str(data["key_id"])] = limits
            key_projects[str(data["key_id"])] = str(data["project"])
    return StoredLimits(projects, keys, key_projects)


class LimitStore(ABC):
    @abstractmethod
    async def load(self) -> StoredLimits:
        """Every stored record."""

    @abstractmethod
    async def put(self, scope: LimitScope, limits: Limits) -> None:
        """Set the scope's record (replacing it), then bump the version and notify."""

    @abstractmethod
    async def delete(self, scope: LimitScope) -> bool:
        """Drop the scope's record (False when there was none), then bump and notify."""

    @abstractmethod
    async def version(self) -> int:
        """Grows on every change; 0 before the first."""

    async def open_change_feed(self) -> ChangeFeed | None:
        """A push feed of changes (Redis pub/sub); None where the store has none."""
        return None

    @abstractmethod
    async def close(self) -> None: ...


class RedisLimitStore(LimitStore):
    def __init__(self, client: Any, owns_client: bool = False) -> None:
        self.client = client
        self._owns_client = owns_client

    async def load(self) -> StoredLimits:
        return _decode(list((await self.client.hgetall(RECORDS_KEY)).values()))

    async def put(self, scope: LimitScope, limits: Limits) -> None:
        await self.client.hset(RECORDS_KEY, scope.field, _encode(scope, limits))
        await self._changed(scope)

    async def delete(self, scope: LimitScope) -> bool:
        removed = bool(await self.client.hdel(RECORDS_KEY, scope.field))
        await self._changed(scope)
        return removed

    async def _changed(self, scope: LimitScope) -> None:
        await self.client.incr(VERSION_KEY)
        await self.client.publish(CHANGES_CHANNEL, scope.field)

    async def version(self) -> int:
        raw = await self.client.get(VERSION_KEY)
        return 0 if raw is None else int(raw)

    async def open_change_feed(self) -> ChangeFeed | None:
        return await open_pubsub_feed(self.client, CHANGES_CHANNEL)

    async def close(self) -> None:
        if self._owns_client:
            await self.client.aclose()


_SCHEMA = """
CREATE TABLE IF NOT EXISTS limit_records (
    scope TEXT PRIMARY KEY, project TEXT NOT NULL, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS limit_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
_BUMP = ("INSERT INTO limit_meta (name, value) VALUES ('version', '1') "
         "ON CONFLICT(name) DO UPDATE SET value = CAST(value AS INTEGER) + 1")


class SqliteLimitStore(LimitStore):
    def __init__(self, runner: Any) -> None:
        self._db = runner

    @classmethod
    async def open(cls, path: Path) -> SqliteLimitStore:
        from auth.sqlite_runner import SqliteRunner

        runner = SqliteRunner(path)
        await runner.run(lambda conn: conn.executescript(_SCHEMA))
        return cls(runner)

    async def load(self) -> StoredLimits:
        rows = await self._db.run(lambda conn: conn.execute(
            "SELECT record FROM limit_records ORDER BY scope").fetchall())
        return _decode([row[0] for row in rows])

    async def _change(self, sql: str, args: tuple[str, ...]) -> int:
        def change(conn: sqlite3.Connection) -> int:
            conn.execute("BEGIN IMMEDIATE")
            try:
                num_rows = conn.execute(sql, args).rowcount
                conn.execute(_BUMP)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            return int(num_rows)

        return int(await self._db.run(change))

    async def put(self, scope: LimitScope, limits: Limits) -> None:
        await self._change("INSERT INTO limit_records (scope, project, record) VALUES (?, ?, ?) "
                           "ON CONFLICT(scope) DO UPDATE SET record = excluded.record",
                           (scope.field, scope.project, _encode(scope, limits)))

    async def delete(self, scope: LimitScope) -> bool:
        return await self._change("DELETE FROM limit_records WHERE scope = ?", (scope.field,)) > 0

    async def version(self) -> int:
        row = await self._db.run(lambda conn: conn.execute(
            "SELECT value FROM limit_meta WHERE name = 'version'").fetchone())
        return 0 if row is None else int(row[0])

    async def close(self) -> None:
        await self._db.close()


async def open_limit_store(redis: Any | None = None, data_dir: Path = Path(".aigw")) -> LimitStore:
    """On `redis` (a decoding redis.asyncio client, not closed by the store) when given, else
    SQLite under data_dir (the same file as the key store and the embedded meter)."""
    if redis is not None:
        return RedisLimitStore(redis)
    return await SqliteLimitStore.open(Path(data_dir) / SQLITE_FILE_NAME)
