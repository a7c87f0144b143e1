"""Stored responses in SQLite (<data_dir>/responses.sqlite3): the store of a gateway without Redis.

    responses(response_id PRIMARY KEY, project, expires_at, num_bytes, body)
    response_bytes(project PRIMARY KEY, num_bytes)   bytes held per project
    response_total(id = 0, num_bytes)                bytes held in all

Triggers keep both totals with every insert and delete, so processes sharing the file (`aigw
serve --workers N`) see one count. Each put, in one transaction: purge expired rows (at most
`_PURGE_BATCH`), insert, then evict the project's, then the store's, soonest-expiring rows until
both fit. A read never returns an expired row, purged or not. The file is created on the first
call, so a gateway that never stores a response writes nothing.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from auth.sqlite_runner import SqliteRunner
from gateway.responses_store.base import ResponseStore, ResponseStoreSettings

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    response_id TEXT PRIMARY KEY, project TEXT NOT NULL, expires_at REAL NOT NULL,
    num_bytes INTEGER NOT NULL, body BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS responses_by_expiry ON responses (expires_at);
CREATE INDEX IF NOT EXISTS responses_by_project ON responses (project, expires_at);
CREATE TABLE IF NOT EXISTS response_bytes (project TEXT PRIMARY KEY, num_bytes INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS response_total (id INTEGER PRIMARY KEY CHECK (id = 0),
                                           num_bytes INTEGER NOT NULL);
INSERT OR IGNORE INTO response_total VALUES (0, 0);
CREATE TRIGGER IF NOT EXISTS response_added AFTER INSERT ON responses BEGIN
    INSERT INTO response_bytes (project, num_bytes) VALUES (NEW.project, NEW.num_bytes)
        ON CONFLICT (project) DO UPDATE SET num_bytes = num_bytes + NEW.num_bytes;
    UPDATE response_total SET num_bytes = num_bytes + NEW.num_bytes;
END;
CREATE TRIGGER IF NOT EXISTS response_removed AFTER DELETE ON responses BEGIN
    UPDATE response_bytes SET num_bytes = num_bytes - OLD.num_bytes WHERE project = OLD.project;
    UPDATE response_total SET num_bytes = num_bytes - OLD.num_bytes;
END;
"""
_PURGE_BATCH = 1000  # expired rows deleted per put at most (the rest on later puts)
_EVICT_BATCH = 1  # one at a time: no more evicted than needed


class SqliteResponseStore(ResponseStore):
    def __init__(self, settings: ResponseStoreSettings, path: Path) -> None:
        super().__init__(settings)
        self._db = SqliteRunner(path)
        self._has_schema = False

    def _ready(self, conn: sqlite3.Connection) -> None:
        if not self._has_schema:  # (on the runner's one thread)
            conn.executescript(_SCHEMA)
            self._has_schema = True

    async def put(self, project: str, response_id: str, body: bytes) -> bool:
        if len(body) > self.settings.max_response_bytes:
            return False
        settings = self.settings

        def put(conn: sqlite3.Connection) -> bool:
            self._ready(conn)
            now = time.time()
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.execute("DELETE FROM responses WHERE rowid IN (SELECT rowid FROM responses "
                             "WHERE expires_at <= ? LIMIT ?)", (now, _PURGE_BATCH))
                conn.execute("INSERT INTO responses VALUES (?, ?, ?, ?, ?)",
                             (response_id, project, now + settings.ttl_s, len(body), body))
                _evict(conn, "SELECT num_bytes FROM response_bytes WHERE project = ?",
                       "SELECT rowid FROM responses WHERE project = ? AND response_id != ? "
                       "ORDER BY expires_at LIMIT ?", (project,), settings.max_project_bytes,
                       response_id)
                _evict(conn, "SELECT num_bytes FROM response_total", "SELECT rowid FROM responses "
                       "WHERE response_id != ? ORDER BY expires_at LIMIT ?", (),
                       settings.max_bytes, response_id)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            return True

        return await self._db.run(put)

    async def get(self, project: str, response_id: str) -> bytes | None:
        def get(conn: sqlite3.Connection) -> bytes | None:
            self._ready(conn)
            row = conn.execute("SELECT body FROM responses WHERE response_id = ? AND project = ? "
                               "AND expires_at > ?", (response_id, project, time.time())).fetchone()
            return None if row is None else bytes(row[0])

        return await self._db.run(get)

    async def delete(self, project: str, response_id: str) -> bool:
        def delete(conn: sqlite3.Connection) -> bool:
            self._ready(conn)
            cursor = conn.execute("DELETE FROM responses WHERE response_id = ? AND project = ? "
                                  "AND expires_at > ?", (response_id, project, time.time()))
            return cursor.rowcount > 0

        return await self._db.run(delete)

    async def num_bytes(self) -> int:
        def total(conn: sqlite3.Connection) -> int:
            self._ready(conn)
            return int(conn.execute("SELECT num_bytes FROM response_total").fetchone()[0])

        return await self._db.run(total)

    async def close(self) -> None:
        await self._db.close()


def _evict(conn: sqlite3.Connection, total_sql: str, oldest_sql: str, scope: tuple[str, ...],
           max_bytes: int, keep_id: str) -> None:
    """Delete the soonest-expiring rows of a scope (not `keep_id`) until it holds <= max_bytes."""
    while int(conn.execute(total_sql, scope).fetchone()[0]) > max_bytes:
        rows = conn.execute(oldest_sql, (*scope, keep_id, _EVICT_BATCH)).fetchall()
        if not rows:
            return
        conn.executemany("DELETE FROM responses WHERE rowid = ?", rows)
