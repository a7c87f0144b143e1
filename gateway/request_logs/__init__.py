"""Request logs (inference tables): sampled request and response bodies of the projects that opt
in, with usage, cost, latency and trace id, redacted and bounded, written off the request path
(writer.py) to SQLite or Redis Streams, read through the admin API (admin_routes.py).

    request_log = await open_request_log(settings.request_logs, redis=client, data_dir=...)
    await request_log.start() ... await request_log.close(); await request_log.store.close()
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gateway.request_logs.entry import Capture, LogEntry
from gateway.request_logs.settings import ProjectLogSettings, RequestLogSettings
from gateway.request_logs.store import LogQuery, RequestLogStore
from gateway.request_logs.writer import RequestLog


async def open_request_log(settings: RequestLogSettings, redis: Any | None = None,
                           data_dir: Path = Path(".aigw")) -> RequestLog:
    """A RequestLog on Redis Streams (`redis`: a decode_responses client, not closed here) or on
    <data_dir>/request_logs.sqlite3, as `settings.store` says ("auto": Redis when given)."""
    if settings.store == "redis" and redis is None:
        raise ValueError("request_logs.store is 'redis' but no redis_url is set")
    store: RequestLogStore
    if redis is not None and settings.store != "sqlite":
        from gateway.request_logs.store_redis import RedisLogStore

        store = RedisLogStore(redis, settings.retention_s,
                              settings.max_project_bytes // settings.max_entry_bytes)
    else:
        from gateway.request_logs.store_sqlite import SqliteLogStore

        store = await SqliteLogStore.open(data_dir, settings.retention_s,
                                          settings.max_project_bytes)
    return RequestLog(settings, store)


__all__ = ["Capture", "LogEntry", "LogQuery", "ProjectLogSettings", "RequestLog",
           "RequestLogSettings", "RequestLogStore", "open_request_log"]
