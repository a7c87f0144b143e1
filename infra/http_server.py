"""An aiohttp AppRunner whose connections must finish a request's headers in time.

    runner = GuardedAppRunner(app, header_timeout_s=10.0, handler_cancellation=True)

aiohttp bounds an idle connection (`keepalive_timeout`) but not one that has started a request:
a client that sends half its headers, or one byte of them every few seconds, held its connection
(and a file descriptor, and the parser's buffer) for as long as it liked. Here the time from the
first byte of a request to its last header is at most `header_timeout_s`; past it the connection
gets `408 Request Timeout` and is closed (no route is known yet, so no dialect's envelope: the
status line says it all). The body is bounded by whoever reads it (infra/json_body.py's
`timeout_s`). One warning line per closed connection, no traceback.

This reaches into aiohttp's RequestHandler (its request count and message queue, pinned by the
version in pyproject.toml); tests/gateway/test_slow_clients.py fails if a release changes them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger("aigw.http")
_TIMEOUT_ANSWER = (b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n"
                   b"\r\n")


class _HeaderTimedHandler(RequestHandler):  # type: ignore[misc]
    __slots__ = ("_header_timeout_s", "_header_timer", "_last_payload")

    def __init__(self, *args: Any, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._header_timer: asyncio.TimerHandle | None = None
        self._last_payload: Any = None  # the body stream of the newest request parsed

    def data_received(self, data: bytes) -> None:
        num_requests = self._request_count
        super().data_received(data)
        if self._request_count != num_requests:  # a request's headers are complete
            self._last_payload = self._messages[-1][1] if self._messages else None
            self._cancel_header_timer()
        if (data and self._header_timer is None and self._request_count == num_requests
                and (self._last_payload is None or self._last_payload.is_eof())):
            # bytes of a request whose headers have not all come (not of a body)
            self._header_timer = self._loop.call_later(self._header_timeout_s,
                                                       self._on_header_timeout)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self._request_in_progress:  # a pipelined request behind one still answering
            self._header_timer = self._loop.call_later(self._header_timeout_s,
                                                       self._on_header_timeout)
            return
        transport = self.transport
        peer = transport.get_extra_info("peername") if transport is not None else None
        log.warning("closing a connection from %s: its request headers did not arrive within "
                    "%gs", peer, self._header_timeout_s)
        if transport is not None and not transport.is_closing():
            transport.write(_TIMEOUT_ANSWER)
        self.force_close()


class _HeaderTimedServer(web.Server):
    def __init__(self, *args: Any, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timeout_s = header_timeout_s

    def __call__(self) -> RequestHandler:
        return _HeaderTimedHandler(self, loop=self._loop, header_timeout_s=self._header_timeout_s,
                                   **self._kwargs)


class GuardedAppRunner(web.AppRunner):
    """`web.AppRunner` with a request-header deadline on every connection."""

    def __init__(self, app: web.Application, *, header_timeout_s: float, **kwargs: Any) -> None:
        if not header_timeout_s > 0:
            raise ValueError(f"header_timeout_s must be > 0, not {header_timeout_s}")
        super().__init__(app, **kwargs)
        self._header_timeout_s = header_timeout_s

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()  # the app's startup runs here
        return _HeaderTimedServer(
            server.request_handler, request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation, loop=server._loop,
            header_timeout_s=self._header_timeout_s, **server._kwargs)
