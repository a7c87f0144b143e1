"""The embedded meter: usage in SQLite (<data_dir>/aigw.sqlite3), limits in this process.

    usage(request_id PRIMARY KEY, project, key_id, model, endpoint, prompt_tokens, cached_tokens,
          completion_tokens, cost_nanos, latency_ms, status, created_at, day, stream, finish_reason,
          reasoning_tokens)

`INSERT OR IGNORE` on the request id makes settle idempotent; only a row that was really inserted
moves the limit counters (for `settle_nowait`, when its batch is written). Reads wait for queued
inserts first. Budgets survive restarts: a scope's spend of the day is read back from
the table the first time it is needed. Limits are per process (one embedded gateway).
"""

from __future__ import annotations

import json
import logging
import operator
import sqlite3
import time
from functools import partial
from pathlib import Path

from auth.sqlite_runner import SqliteRunner
from gateway.metering.budgets import Window
from gateway.metering.coalescer import Coalescer
from gateway.metering.contract import UsageRecord
from gateway.metering.limits import (
    Clock,
    LocalLimiter,
    MeterAdmission,
    ScopeLimits,
    Spend,
    rate_headers,
)
from gateway.metering.meter import SETTLE_LINGER_S, BaseMeter, usage_day
from gateway.metering.settings import MeteringSettings
from gateway.metering.usage_report import UsageRow

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    request_id TEXT PRIMARY KEY, project TEXT NOT NULL, key_id TEXT NOT NULL, model TEXT NOT NULL,
    endpoint TEXT NOT NULL, prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL, cost_nanos INTEGER NOT NULL, latency_ms REAL NOT NULL,
    status INTEGER NOT NULL, created_at REAL NOT NULL, day TEXT NOT NULL, stream INTEGER NOT NULL,
    finish_reason TEXT, reasoning_tokens INTEGER NOT NULL DEFAULT 0, session_id TEXT,
    tags TEXT NOT NULL DEFAULT '[]');
CREATE INDEX IF NOT EXISTS usage_by_project_day ON usage (project, day);
CREATE TABLE IF NOT EXISTS limit_alerts (
    project TEXT NOT NULL, scope TEXT NOT NULL, window TEXT NOT NULL, threshold REAL NOT NULL,
    sent_at REAL NOT NULL, PRIMARY KEY (project, scope, window, threshold));
"""
# a database made before reasoning_tokens: the column is added, its rows read back as 0
_MIGRATIONS = {"reasoning_tokens": "ALTER TABLE usage ADD COLUMN reasoning_tokens INTEGER NOT NULL "
                                   "DEFAULT 0",
               "session_id": "ALTER TABLE usage ADD COLUMN session_id TEXT",
               "tags": "ALTER TABLE usage ADD COLUMN tags TEXT NOT NULL DEFAULT '[]'"}
_RECORD_COLUMNS = ("request_id", "project", "key_id", "model", "endpoint", "prompt_tokens",
                   "cached_tokens", "completion_tokens", "latency_ms", "status", "created_at",
                   "stream", "finish_reason", "reasoning_tokens", "session_id")

log = logging.getLogger("aigw.metering")

_INSERT_SQL = (f"INSERT OR IGNORE INTO usage ({', '.join(_RECORD_COLUMNS)}, cost_nanos, day, tags) "
               f"VALUES ({', '.join('?' * (len(_RECORD_COLUMNS) + 3))})")


def _create_or_migrate(conn: sqlite3.Connection) -> None:
    conn.executescript(_SCHEMA)
    columns = {row[1] for row in conn.execute("PRAGMA table_info(usage)")}
    for column, statement in _MIGRATIONS.items():
        if column not in columns:
            conn.execute(statement)


class EmbeddedMeter(BaseMeter):
    def __init__(self, settings: MeteringSettings, runner: SqliteRunner) -> None:
        super().__init__(settings)
        self._db = runner
        self._limiter = LocalLimiter()
        self._inserts: Coalescer[tuple[object, ...], bool] = Coalescer(
            self._insert_rows, linger_s=SETTLE_LINGER_S, size_of=_row_bytes)

    def backlog_bytes(self) -> int:
        """Rows queued or in a transaction not yet done (a stalled disk keeps them here)."""
        return self._inserts.backlog_bytes

    @classmethod
    async def open(cls, settings: MeteringSettings, path: Path) -> EmbeddedMeter:
        runner = SqliteRunner(path)
        await runner.run(_create_or_migrate)
        return cls(settings, runner)

    async def _reserve(self, admission: MeterAdmission, scopes: list[ScopeLimits],
                       clock: Clock) -> None:
        for scope in scopes:
            for window in scope.windows_at(clock.now):
                if not self._limiter.has_spent(scope, window):
                    self._limiter.seed_spent(scope, window,
                                             await self._spent_in(admission, scope, window))
        after, refusal = self._limiter.admit(admission, scopes, clock)
        if refusal is not None:
            raise refusal
        admission.minute_window = clock.minute_window
        admission.headers = rate_headers(after, clock)

    async def _spent_in(self, admission: MeterAdmission, scope: ScopeLimits,
                        window: Window) -> int:
        """What the usage table holds for the scope in the window (a restart keeps budgets)."""
        await self._inserts.flush()
        sql = ("SELECT SUM(cost_nanos) FROM usage WHERE project = ? AND day >= ? AND day <= ? "
               "AND created_at >= ? AND created_at < ?")
        args: tuple[object, ...] = (admission.principal.project, usage_day(window.start_s),
                                    usage_day(window.end_s), window.start_s, window.end_s)
        if not scope.is_project:
            sql, args = sql + " AND key_id = ?", (*args, admission.principal.key_id)
        row = await self._db.run(lambda conn: conn.execute(sql, args).fetchone())
        return int(row[0] or 0)

    async def _claim_alert(self, spend: Spend, threshold: float) -> bool:
        scope = spend.scope
        args = (scope.project, scope.name, spend.window.key, threshold, time.time())
        return bool(await self._db.run(lambda conn: conn.execute(
            "INSERT OR IGNORE INTO limit_alerts (project, scope, window, threshold, sent_at) "
            "VALUES (?, ?, ?, ?, ?)", args).rowcount))

    async def _record(self, admission: MeterAdmission, record: UsageRecord, cost_nanos: int,
                      delta_tokens: int, delta_nanos: int) -> None:
        if admission.concurrent_scopes:  # (its concurrency slots; none: nothing to release)
            self._limiter.release(admission)
        if await self._inserts.submit(_row(record, cost_nanos)) and admission.scopes:
            self._observe_spends(self._limiter.settle(admission, delta_tokens, delta_nanos))

    def _record_nowait(self, admission: MeterAdmission, record: UsageRecord, cost_nanos: int,
                       delta_tokens: int, delta_nanos: int) -> None:
        if admission.concurrent_scopes:
            self._limiter.release(admission)
        self._inserts.submit_nowait(_row(record, cost_nanos), partial(
            self._on_inserted, admission, record.request_id, delta_tokens, delta_nanos))

    def _on_inserted(self, admission: MeterAdmission, request_id: str, delta_tokens: int,
                     delta_nanos: int, inserted: bool | BaseException) -> None:
        if isinstance(inserted, BaseException):
            log.error("settle failed for %s", request_id, exc_info=inserted)
        elif inserted and admission.scopes:
            self._observe_spends(self._limiter.settle(admission, delta_tokens, delta_nanos))

    async def _insert_rows(self, rows: list[tuple[object, ...]]) -> list[bool | BaseException]:
        """One transaction for a batch (group commit); True for each row really inserted."""
        def insert(conn: sqlite3.Connection) -> list[bool | BaseException]:
            inserted: list[bool | BaseException] = []
            conn.execute("BEGIN")
            try:
                for row in rows:
                    inserted.append(conn.execute(_INSERT_SQL, row).rowcount == 1)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            return inserted

        return await self._db.run(insert)

    async def _daily_rows(self, project: str, since: str | None,
                          until: str | None) -> list[UsageRow]:
        sql = ("SELECT day, model, COUNT(*), SUM(prompt_tokens), SUM(cached_tokens), "
               "SUM(completion_tokens), SUM(cost_nanos) FROM usage WHERE project = ? "
               "AND day >= ? AND day <= ? GROUP BY day, model")
        args = (project, since or "", until or "9999-99-99")
        await self._inserts.flush()
        rows = await self._db.run(lambda conn: conn.execute(sql, args).fetchall())
        return [UsageRow(*row) for row in rows]

    async def usage_records(self, project: str, since: str | None = None,
                            until: str | None = None) -> list[UsageRecord]:
        sql = (f"SELECT {', '.join(_RECORD_COLUMNS)}, cost_nanos, tags FROM usage WHERE project = "
               "? AND day >= ? AND day <= ? ORDER BY created_at, request_id")
        args = (project, since or "", until or "9999-99-99")
        await self._inserts.flush()
        rows = await self._db.run(lambda conn: conn.execute(sql, args).fetchall())
        records = []
        for row in rows:
            fields = dict(zip(_RECORD_COLUMNS, row[:-2], strict=True))
            fields["stream"] = bool(fields["stream"])
            records.append(UsageRecord(**fields, cost_usd=row[-2] / 1e9,
                                       tags=tuple(json.loads(row[-1]))))
        return records

    async def close(self) -> None:
        await self._inserts.close()
        await self._close_alerts()
        await self._db.close()


_record_columns = operator.attrgetter(*_RECORD_COLUMNS)  # (one C call, no generator per field)


def _row(record: UsageRecord, cost_nanos: int) -> tuple[object, ...]:
    return _record_columns(record) + (
        cost_nanos, usage_day(record.created_at), json.dumps(record.tags) if record.tags else "[]")


_ROW_FIXED_BYTES = 200 + 8 * 9  # the tuple, and its 9 numbers (tokens, latency, status, ...)


def _row_bytes(row: tuple[object, ...]) -> int:
    """What a queued row weighs: its strings, 8 a number, plus a fixed 200 for the tuple. In few
    calls (it is taken at every submit and delivery): `_row` puts the strings at 0-4 (request_id ..
    endpoint), 16 (day) and 17 (tags JSON), finish_reason and session_id (a string or None) at 12
    and 14, numbers everywhere else."""
    strings = row[0] + row[1] + row[2] + row[3] + row[4] + row[16] + row[17]  # type: ignore[operator]
    finish, session = row[12], row[14]
    return (_ROW_FIXED_BYTES + len(strings) + (8 if finish is None else len(finish))  # type: ignore[arg-type]
            + (8 if session is None else len(session)))  # type: ignore[arg-type]
