"""Request logs in SQLite: <data_dir>/request_logs.sqlite3, its own file and writer thread (so
log writes never queue behind usage writes).

    request_logs(seq INTEGER PRIMARY KEY AUTOINCREMENT, id, project, model, trace_id, created_at,
                 num_bytes, entry)            index (project, seq), (trace_id), (created_at)
    request_log_totals(project PRIMARY KEY, num_bytes)     kept in the same transactions
    request_log_settings(project PRIMARY KEY, settings)    JSON, set through the admin API
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import orjson

from auth.sqlite_runner import SqliteRunner
from gateway.request_logs.entry import LogEntry
from gateway.request_logs.store import MAX_PAGE, LogQuery, RequestLogStore

FILE_NAME = "request_logs.sqlite3"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS request_logs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL, project TEXT NOT NULL,
    model TEXT NOT NULL, trace_id TEXT, created_at REAL NOT NULL, num_bytes INTEGER NOT NULL,
    entry TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS request_logs_by_project ON request_logs (project, seq);
CREATE INDEX IF NOT EXISTS request_logs_by_trace ON request_logs (trace_id);
CREATE INDEX IF NOT EXISTS request_logs_by_time ON request_logs (created_at);
CREATE TABLE IF NOT EXISTS request_log_totals (project TEXT PRIMARY KEY,
                                               num_bytes INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS request_log_settings (project TEXT PRIMARY KEY, settings TEXT NOT NULL);
"""


class SqliteLogStore(RequestLogStore):
    def __init__(self, runner: SqliteRunner, retention_s: float, max_project_bytes: int) -> None:
        self._db = runner
        self._retention_s = retention_s
        self._max_project_bytes = max_project_bytes

    @classmethod
    async def open(cls, data_dir: Path, retention_s: float, max_project_bytes: int
                   ) -> SqliteLogStore:
        runner = SqliteRunner(Path(data_dir) / FILE_NAME)
        await runner.run(lambda conn: conn.executescript(_SCHEMA))
        return cls(runner, retention_s, max_project_bytes)

    async def append(self, entries: list[LogEntry], now: float) -> None:
        def write(conn: sqlite3.Connection) -> None:
            conn.execute("BEGIN")
            try:
                added: dict[str, int] = {}
                conn.executemany(
                    "INSERT INTO request_logs (id, project, model, trace_id, created_at, "
                    "num_bytes, entry) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    [(e.id, e.project, e.model, e.trace_id, e.created_at, e.num_bytes,
                      e.data.decode()) for e in entries])
                for entry in entries:
                    added[entry.project] = added.get(entry.project, 0) + entry.num_bytes
                for project, num_bytes in added.items():
                    conn.execute("INSERT INTO request_log_totals VALUES (?, ?) ON CONFLICT"
                                 "(project) DO UPDATE SET num_bytes = num_bytes + ?",
                                 (project, num_bytes, num_bytes))
                    _evict(conn, project, self._max_project_bytes)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

        await self._db.run(write)

    async def trim(self, now: float) -> None:
        cutoff = now - self._retention_s

        def delete(conn: sqlite3.Connection) -> None:
            conn.execute("BEGIN")
            try:
                for project, num_bytes in conn.execute(
                        "SELECT project, SUM(num_bytes) FROM request_logs WHERE created_at < ? "
                        "GROUP BY project", (cutoff,)).fetchall():
                    conn.execute("UPDATE request_log_totals SET num_bytes = num_bytes - ? "
                                 "WHERE project = ?", (num_bytes, project))
                conn.execute("DELETE FROM request_logs WHERE created_at < ?", (cutoff,))
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

        await self._db.run(delete)

    async def query(self, query: LogQuery) -> tuple[list[dict[str, Any]], str | None]:
        # (reads skip what is past the retention but not trimmed yet)
        where, args = ["created_at >= ?"], [time.time() - self._retention_s]
        if query.project is not None:
            where.append("project = ?")
            args.append(query.project)  # type: ignore[arg-type]
        for column, value in (("model", query.model), ("trace_id", query.trace_id),
                              ("id", query.request_id)):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)  # type: ignore[arg-type]
        if query.since is not None:
            where.append("created_at >= ?")
            args.append(query.since)
        if query.until is not None:
            where.append("created_at < ?")
            args.append(query.until)
        if query.cursor is not None:
            cursor = query.cursor
            if not (cursor.isascii() and cursor.isdigit() and len(cursor) <= 18):  # (not '²')
                raise ValueError("cursor: not one this store handed out")
            where.append("seq < ?")
            args.append(int(query.cursor))
        limit = min(max(1, query.limit), MAX_PAGE)
        sql = (f"SELECT seq, entry FROM request_logs WHERE {' AND '.join(where)} "
               f"ORDER BY seq DESC LIMIT {limit + 1}")
        rows = await self._db.run(lambda conn: conn.execute(sql, args).fetchall())
        entries = [orjson.loads(row[1]) for row in rows[:limit]]
        return entries, (str(rows[limit - 1][0]) if len(rows) > limit else None)

    async def project_settings(self) -> dict[str, dict[str, Any]]:
        rows = await self._db.run(lambda conn: conn.execute(
            "SELECT project, settings FROM request_log_settings").fetchall())
        return {project: orjson.loads(settings) for project, settings in rows}

    async def put_project_settings(self, project: str, values: dict[str, Any] | None) -> None:
        if values is None:
            await self._db.run(lambda conn: conn.execute(
                "DELETE FROM request_log_settings WHERE project = ?", (project,)))
        else:
            text = orjson.dumps(values).decode()
            await self._db.run(lambda conn: conn.execute(
                "INSERT OR REPLACE INTO request_log_settings VALUES (?, ?)", (project, text)))

    async def close(self) -> None:
        await self._db.close()


def _evict(conn: sqlite3.Connection, project: str, max_bytes: int) -> None:
    """The project's oldest entries deleted until it holds at most `max_bytes`."""
    (total,) = conn.execute("SELECT num_bytes FROM request_log_totals WHERE project = ?",
                            (project,)).fetchone()
    excess = total - max_bytes
    while excess > 0:
        rows = conn.execute("SELECT seq, num_bytes FROM request_logs WHERE project = ? "
                            "ORDER BY seq LIMIT 256", (project,)).fetchall()
        if not rows:
            break
        last, freed = rows[-1][0], 0
        for seq, num_bytes in rows:
            freed += num_bytes
            if freed >= excess:
                last = seq
                break
        conn.execute("DELETE FROM request_logs WHERE project = ? AND seq <= ?", (project, last))
        conn.execute("UPDATE request_log_totals SET num_bytes = num_bytes - ? WHERE project = ?",
                     (freed, project))
        excess -= freed
