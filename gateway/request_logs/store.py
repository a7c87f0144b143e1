"""Where request log entries live: the contract both stores keep (SQLite: store_sqlite.py, Redis
Streams: store_redis.py), and the query the admin API runs.

Entries come back newest first, as their JSON objects; a page's `next_cursor` (opaque) asks for
the entries after it. Project log settings set through the admin API live in the same store, so
every gateway instance on it sees them (`project_settings`, re-read every `settings_refresh_s`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from gateway.request_logs.entry import LogEntry

MAX_PAGE = 200


@dataclass(frozen=True, slots=True)
class LogQuery:
    """`project` None: every project (admin only; the Redis store then needs `trace_id`)."""

    project: str | None
    model: str | None = None
    trace_id: str | None = None
    request_id: str | None = None
    since: float | None = None  # unix seconds, inclusive
    until: float | None = None  # unix seconds, exclusive
    limit: int = 50
    cursor: str | None = None


class RequestLogStore(ABC):
    @abstractmethod
    async def append(self, entries: list[LogEntry], now: float) -> None:
        """Store `entries`; then each project they touch holds at most `max_project_bytes`
        (its oldest entries deleted first) and nothing older than the retention."""

    @abstractmethod
    async def query(self, query: LogQuery) -> tuple[list[dict[str, Any]], str | None]:
        """(entries newest first, the cursor of the next page or None). ValueError for a query
        this store cannot answer or a malformed cursor."""

    @abstractmethod
    async def trim(self, now: float) -> None:
        """Delete what is past the retention (stores that do not expire entries themselves)."""

    @abstractmethod
    async def project_settings(self) -> dict[str, dict[str, Any]]:
        """project -> the settings set through the admin API ({"enabled", "sample_rate"})."""

    @abstractmethod
    async def put_project_settings(self, project: str, values: dict[str, Any] | None) -> None:
        """Set a project's settings; None removes them (the config's apply again)."""

    @abstractmethod
    async def close(self) -> None: ...
