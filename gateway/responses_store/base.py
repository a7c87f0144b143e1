"""The stored-responses contract: what the Responses API keeps of each answer, per project.

A stored response is one opaque JSON body (gateway/responses_store/conversation.py writes and reads
it: the response object and the conversation's input items) under its response id, owned by one
project. A store:

    put     keeps it for `ttl_s`; refuses (False) a body over `max_response_bytes`; then, while the
            project holds more than `max_project_bytes`, or the store more than `max_bytes`, drops
            the responses that expire first (the oldest, with one TTL) until it fits
    get     the body, or None when there is none for that project (never stored, deleted,
            expired, evicted, or another project's: one answer for all, so a caller learns nothing
            of other projects' ids)
    delete  True if it removed one

Backends: SQLite (sqlite_store.py, one file under `data_dir`, for a gateway without Redis) and
Redis (redis_store.py: keys with a TTL). `open_response_store` in the package picks one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ResponseStoreSettings:
    """Retention and byte bounds (GatewaySettings.responses_store_*)."""

    ttl_s: float = 30 * 24 * 3600.0
    max_response_bytes: int = 16 * 1024 * 1024
    max_project_bytes: int = 256 * 1024 * 1024
    max_bytes: int = 1024 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.ttl_s <= 0:
            raise ValueError("responses_store_ttl_s must be > 0")
        if not 0 < self.max_response_bytes <= self.max_project_bytes <= self.max_bytes:
            raise ValueError("the responses store needs 0 < responses_store_max_response_bytes <= "
                             "responses_store_max_project_bytes <= responses_store_max_bytes")


class ResponseStore(ABC):
    """Stored responses by (project, response id). Safe to call from one event loop; the
    backends serialize their own writes."""

    def __init__(self, settings: ResponseStoreSettings) -> None:
        self.settings = settings

    @abstractmethod
    async def put(self, project: str, response_id: str, body: bytes) -> bool:
        """Keep `body` for `settings.ttl_s`. False (nothing kept) when it is over
        `settings.max_response_bytes`; older responses may be evicted to make room."""

    @abstractmethod
    async def get(self, project: str, response_id: str) -> bytes | None:
        """The body stored for this project under `response_id`, unless expired or gone."""

    @abstractmethod
    async def delete(self, project: str, response_id: str) -> bool:
        """Remove it; True if there was one (for this project, unexpired)."""

    @abstractmethod
    async def num_bytes(self) -> int:
        """Bytes of bodies held now (expired ones not yet purged included)."""

    @abstractmethod
    async def close(self) -> None: ...
