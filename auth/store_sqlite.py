"""The embedded key store: SQLite under data_dir (<data_dir>/aigw.sqlite3), surviving restarts.

Tables: projects(name, created_at), api_keys(key_id, project, created_at, record JSON),
auth_meta(name, value) holding `revocation_version` and `pepper`. A CLI in another process shares
the file (WAL); running gateways see its revocations by polling the revocation version.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from auth.keys import KeyRecord, ProjectRecord
from auth.sqlite_runner import SqliteRunner
from auth.store import KeyStore, ProjectExists, UnknownKey

_SCHEMA = """
CREATE TABLE IF NOT EXISTS projects (name TEXT PRIMARY KEY, created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS api_keys (
    key_id TEXT PRIMARY KEY, project TEXT NOT NULL, created_at REAL NOT NULL, record TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS api_keys_by_project ON api_keys (project, created_at);
CREATE TABLE IF NOT EXISTS auth_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


class SqliteKeyStore(KeyStore):
    def __init__(self, runner: SqliteRunner) -> None:
        self._db = runner

    @classmethod
    async def open(cls, path: Path) -> SqliteKeyStore:
        runner = SqliteRunner(path)
        await runner.run(lambda conn: conn.executescript(_SCHEMA))
        return cls(runner)

    async def create_project(self, project: ProjectRecord) -> None:
        def insert(conn: sqlite3.Connection) -> None:
            try:
                conn.execute("INSERT INTO projects (name, created_at) VALUES (?, ?)",
                             (project.name, project.created_at))
            except sqlite3.IntegrityError as exc:
                raise ProjectExists(project.name) from exc

        await self._db.run(insert)

    async def get_project(self, name: str) -> ProjectRecord | None:
        row = await self._db.run(lambda conn: conn.execute(
            "SELECT name, created_at FROM projects WHERE name = ?", (name,)).fetchone())
        return None if row is None else ProjectRecord(row[0], row[1])

    async def list_projects(self) -> list[ProjectRecord]:
        rows = await self._db.run(lambda conn: conn.execute(
            "SELECT name, created_at FROM projects ORDER BY name").fetchall())
        return [ProjectRecord(name, created_at) for name, created_at in rows]

    async def add_key(self, record: KeyRecord) -> None:
        await self._db.run(lambda conn: conn.execute(
            "INSERT INTO api_keys (key_id, project, created_at, record) VALUES (?, ?, ?, ?)",
            (record.key_id, record.project, record.created_at, json.dumps(record.to_json_dict()))))

    async def get_key(self, key_id: str) -> KeyRecord | None:
        row = await self._db.run(lambda conn: conn.execute(
            "SELECT record FROM api_keys WHERE key_id = ?", (key_id,)).fetchone())
        return None if row is None else KeyRecord.from_json_dict(json.loads(row[0]))

    async def list_keys(self, project: str) -> list[KeyRecord]:
        rows = await self._db.run(lambda conn: conn.execute(
            "SELECT record FROM api_keys WHERE project = ? ORDER BY created_at, key_id",
            (project,)).fetchall())
        return [KeyRecord.from_json_dict(json.loads(row[0])) for row in rows]

    async def replace_key(self, record: KeyRecord) -> None:
        def update(conn: sqlite3.Connection) -> None:
            conn.execute("BEGIN IMMEDIATE")
            try:
                cursor = conn.execute("UPDATE api_keys SET record = ? WHERE key_id = ?",
                                      (json.dumps(record.to_json_dict()), record.key_id))
                if cursor.rowcount != 1:
                    raise UnknownKey(record.key_id)
                conn.execute(
                    "INSERT INTO auth_meta (name, value) VALUES ('revocation_version', '1') "
                    "ON CONFLICT(name) DO UPDATE SET value = CAST(value AS INTEGER) + 1")
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

        await self._db.run(update)

    async def revocation_version(self) -> int:
        row = await self._db.run(lambda conn: conn.execute(
            "SELECT value FROM auth_meta WHERE name = 'revocation_version'").fetchone())
        return 0 if row is None else int(row[0])

    async def load_or_create_pepper(self, candidate: bytes) -> bytes:
        def load(conn: sqlite3.Connection) -> bytes:
            conn.execute("INSERT OR IGNORE INTO auth_meta (name, value) VALUES ('pepper', ?)",
                         (candidate.hex(),))
            row = conn.execute("SELECT value FROM auth_meta WHERE name = 'pepper'").fetchone()
            return bytes.fromhex(row[0])

        return await self._db.run(load)

    async def close(self) -> None:
        await self._db.close()
