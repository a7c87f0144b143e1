"""The embedded `BatchStore`: one SQLite file (`<data_dir>/batch.sqlite3`), WAL, one writer thread.

    files(id PRIMARY KEY, project, purpose, filename, num_bytes, created_at)
    batches(id PRIMARY KEY, project, created_at, status, body, cancelling_at, lease_owner,
            lease_until)
    lines(batch_id, idx, ok, output, record, metered, PRIMARY KEY (batch_id, idx))

`INSERT OR IGNORE` on (batch_id, idx) keeps the first result of a line; a batch's `body` is
its JSON without `cancelling_at`, which only a cancel writes.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson

from auth.sqlite_runner import SqliteRunner
from gateway.batch.records import BatchRecord, BatchStatus, FileRecord, LineResult
from gateway.batch.store import BatchStore

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, project TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    num_bytes INTEGER NOT NULL, created_at INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS files_by_project ON files (project, created_at, id);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, project TEXT NOT NULL, created_at INTEGER NOT NULL, status TEXT NOT NULL,
    body TEXT NOT NULL, cancelling_at INTEGER, lease_owner TEXT, lease_until REAL);
CREATE INDEX IF NOT EXISTS batches_by_project ON batches (project, created_at, id);
CREATE INDEX IF NOT EXISTS batches_by_status ON batches (status);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, idx INTEGER NOT NULL, ok INTEGER NOT NULL, output BLOB NOT NULL,
    record BLOB, metered INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (batch_id, idx));
"""
_ACTIVE = tuple(s.value for s in BatchStatus if s.is_active)
_LINE_PAGE = 512  # rows read at a time when writing the output files


def _file(row: tuple[Any, ...]) -> FileRecord:
    return FileRecord(id=row[0], project=row[1], purpose=row[2], filename=row[3],
                      num_bytes=row[4], created_at=row[5])


def _batch(row: tuple[Any, ...]) -> BatchRecord:
    record = BatchRecord.from_json(orjson.loads(row[0]))
    record.cancelling_at = row[1]
    return record


def _body(record: BatchRecord) -> bytes:
    data = record.to_json()
    data.pop("cancelling_at")
    return orjson.dumps(data)


class SqliteBatchStore(BatchStore):
    def __init__(self, runner: SqliteRunner) -> None:
        self._db = runner

    @classmethod
    async def open(cls, path: Path) -> SqliteBatchStore:
        runner = SqliteRunner(path)
        await runner.run(lambda conn: conn.executescript(_SCHEMA))
        return cls(runner)

    async def _all(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        return await self._db.run(lambda conn: conn.execute(sql, args).fetchall())

    async def _one(self, sql: str, *args: Any) -> tuple[Any, ...] | None:
        rows = await self._all(sql, *args)
        return rows[0] if rows else None

    async def _exec(self, sql: str, *args: Any) -> int:
        return await self._db.run(lambda conn: conn.execute(sql, args).rowcount)

    async def add_file(self, record: FileRecord) -> None:
        await self._exec("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?)", record.id,
                         record.project, record.purpose, record.filename, record.num_bytes,
                         record.created_at)

    async def get_file(self, project: str, file_id: str) -> FileRecord | None:
        row = await self._one("SELECT * FROM files WHERE id = ? AND project = ?", file_id, project)
        return None if row is None else _file(row)

    async def list_files(self, project: str, purpose: str | None, after: str | None,
                         limit: int, newest_first: bool) -> tuple[list[FileRecord], bool]:
        rows = await self._page("files", project, after, limit, newest_first,
                                ("purpose", purpose) if purpose else None, "*")
        return [_file(row) for row in rows[:limit]], len(rows) > limit

    async def _page(self, table: str, project: str, after: str | None, limit: int,
                    newest_first: bool, where: tuple[str, str] | None, columns: str
                    ) -> list[tuple[Any, ...]]:
        sql = f"SELECT {columns} FROM {table} WHERE project = ?"  # (table, columns: ours)
        args: list[Any] = [project]
        if where is not None:
            sql += f" AND {where[0]} = ?"
            args.append(where[1])
        if after is not None:
            anchor = await self._one(f"SELECT created_at FROM {table} WHERE id = ? AND project = ?",
                                     after, project)
            if anchor is None:
                return []
            sql += f" AND (created_at, id) {'<' if newest_first else '>'} (?, ?)"
            args += [anchor[0], after]
        order = "DESC" if newest_first else "ASC"
        sql += f" ORDER BY created_at {order}, id {order} LIMIT ?"
        args.append(limit + 1)
        return await self._all(sql, *args)

    async def delete_file(self, project: str, file_id: str) -> bool:
        return await self._exec("DELETE FROM files WHERE id = ? AND project = ?", file_id,
                                project) == 1

    async def project_bytes(self, project: str) -> int:
        row = await self._one("SELECT COALESCE(SUM(num_bytes), 0) FROM files WHERE project = ?",
                              project)
        return int(row[0]) if row else 0

    async def add_batch(self, record: BatchRecord) -> None:
        await self._exec("INSERT INTO batches (id, project, created_at, status, body) "
                         "VALUES (?, ?, ?, ?, ?)", record.id, record.project, record.created_at,
                         record.status, _body(record))

    async def get_batch(self, project: str, batch_id: str) -> BatchRecord | None:
        row = await self._one("SELECT body, cancelling_at FROM batches WHERE id = ? AND project = "
                              "?",
                              batch_id, project)
        return None if row is None else _batch(row)

    async def get_batch_any(self, batch_id: str) -> BatchRecord | None:
        row = await self._one("SELECT body, cancelling_at FROM batches WHERE id = ?", batch_id)
        return None if row is None else _batch(row)

    async def list_batches(self, project: str, after: str | None, limit: int
                           ) -> tuple[list[BatchRecord], bool]:
        rows = await self._page("batches", project, after, limit, True, None,
                                "body, cancelling_at")
        return [_batch(row) for row in rows[:limit]], len(rows) > limit

    async def save_batch(self, record: BatchRecord) -> None:
        await self._exec("UPDATE batches SET status = ?, body = ? WHERE id = ?", record.status,
                         _body(record), record.id)

    async def request_cancel(self, project: str, batch_id: str, at: int) -> BatchRecord | None:
        await self._exec("UPDATE batches SET cancelling_at = ? WHERE id = ? AND project = ? AND "
                         f"cancelling_at IS NULL AND status IN ({', '.join('?' * len(_ACTIVE))})",
                         at, batch_id, project, *_ACTIVE)
        return await self.get_batch(project, batch_id)

    async def active_batch_ids(self) -> list[str]:
        rows = await self._all("SELECT id FROM batches WHERE status IN "
                               f"({', '.join('?' * len(_ACTIVE))}) ORDER BY created_at, id",
                               *_ACTIVE)
        return [row[0] for row in rows]

    async def num_active_batches(self, project: str) -> int:
        row = await self._all("SELECT COUNT(*) FROM batches WHERE project = ? AND status IN "
                              f"({', '.join('?' * len(_ACTIVE))})", project, *_ACTIVE)
        return int(row[0][0])

    async def try_lease(self, batch_id: str, owner: str, lease_s: float) -> bool:
        now = time.time()
        return await self._exec(
            "UPDATE batches SET lease_owner = ?, lease_until = ? WHERE id = ? AND "
            "(lease_owner IS NULL OR lease_owner = ? OR lease_until < ?)",
            owner, now + lease_s, batch_id, owner, now) == 1

    async def record_line(self, batch_id: str, result: LineResult) -> bool:
        record = None if result.usage_record is None else orjson.dumps(result.usage_record)
        return await self._exec("INSERT OR IGNORE INTO lines VALUES (?, ?, ?, ?, ?, ?)", batch_id,
                                result.index, int(result.ok), result.output, record,
                                int(result.metered)) == 1

    async def mark_metered(self, batch_id: str, index: int) -> None:
        await self._exec("UPDATE lines SET metered = 1 WHERE batch_id = ? AND idx = ?", batch_id,
                         index)

    async def recorded_lines(self, batch_id: str) -> tuple[dict[int, bool], list[LineResult]]:
        def read(conn: sqlite3.Connection) -> tuple[dict[int, bool], list[LineResult]]:
            indexes = {row[0]: bool(row[1]) for row in conn.execute(
                "SELECT idx, ok FROM lines WHERE batch_id = ?", (batch_id,))}
            unmetered = [LineResult(row[0], bool(row[1]), row[2], orjson.loads(row[3]))
                         for row in conn.execute(
                             "SELECT idx, ok, output, record FROM lines WHERE batch_id = ? AND "
                             "metered = 0 AND record IS NOT NULL", (batch_id,))]
            return indexes, unmetered

        return await self._db.run(read)

    async def line_outputs(self, batch_id: str
                           ) -> AsyncIterator[tuple[bool, bytes, dict[str, Any] | None]]:
        last = -1
        while True:
            rows = await self._all("SELECT idx, ok, output, record FROM lines WHERE batch_id = ? "
                                   "AND idx > ? ORDER BY idx LIMIT ?", batch_id, last, _LINE_PAGE)
            for row in rows:
                yield bool(row[1]), bytes(row[2]), None if row[3] is None else orjson.loads(row[3])
            if len(rows) < _LINE_PAGE:
                return
            last = rows[-1][0]

    async def drop_lines(self, batch_id: str) -> None:
        await self._exec("DELETE FROM lines WHERE batch_id = ?", batch_id)

    async def close(self) -> None:
        await self._db.close()
