"""Stored Responses API answers: `store`, `previous_response_id`, GET/DELETE /v1/responses/{id}.

    base.py          ResponseStore (the contract: per-project, TTL, byte bounds), its settings
    sqlite_store.py  SQLite under data_dir (a gateway without Redis)
    redis_store.py   Redis (keys with a TTL; every gateway sharing the Redis sees them)
    conversation.py  StoredResponses: what a response keeps and a continuation reads back

`open_response_store(settings)` picks the backend; nothing connects or writes before the first
stored response.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.responses_store.base import ResponseStore, ResponseStoreSettings
from gateway.responses_store.conversation import StoredResponses

if TYPE_CHECKING:
    from gateway.settings import GatewaySettings

__all__ = ["ResponseStore", "ResponseStoreSettings", "StoredResponses", "open_response_store",
           "store_settings"]


def store_settings(settings: GatewaySettings) -> ResponseStoreSettings:
    return ResponseStoreSettings(ttl_s=settings.responses_store_ttl_s,
                                 max_response_bytes=settings.responses_store_max_response_bytes,
                                 max_project_bytes=settings.responses_store_max_project_bytes,
                                 max_bytes=settings.responses_store_max_bytes)


def open_response_store(settings: GatewaySettings) -> ResponseStore:
    """Redis when `redis_url` is set (a client of its own), else SQLite at
    `<data_dir>/responses.sqlite3`."""
    bounds = store_settings(settings)
    if settings.redis_url:
        from gateway.responses_store.redis_store import RedisResponseStore
        from infra.redis_client import connect_redis

        return RedisResponseStore(bounds, connect_redis(settings.redis_url), owns_client=True)
    from gateway.responses_store.sqlite_store import SqliteResponseStore

    return SqliteResponseStore(bounds, settings.data_dir / "responses.sqlite3")
