"""Server-sent events, written as OpenAI streams them: `data: <json>\\n\\n` ... `data: [DONE]`.

Each event is flushed as it is written. A write to a client that has gone raises `ClientGone`,
which the stream loops treat as the end of the request (their `finally` aborts the engine work).
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from contracts.replica_errors import error_body


class ClientGone(Exception):
    """The client closed the connection while we were streaming to it."""


class EventStream:
    def __init__(self, request: web.Request, headers: dict[str, str] | None = None) -> None:
        self._request = request
        self.response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            **(headers or {}),
        })

    async def open(self) -> None:
        await self.response.prepare(self._request)

    async def send(self, payload: dict[str, Any]) -> None:
        await self._write(b"data: " + orjson.dumps(payload) + b"\n\n")

    async def send_done(self) -> None:
        await self._write(b"data: [DONE]\n\n")

    async def send_error(self, message: str) -> None:
        """An OpenAI-style error event; the stream then ends without [DONE]."""
        await self.send(error_body(message, "server_error"))

    async def _write(self, data: bytes) -> None:
        try:
            await self.response.write(data)
        except (ConnectionError, RuntimeError) as exc:  # reset, or transport already closed
            raise ClientGone() from exc
