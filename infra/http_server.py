"""An aiohttp AppRunner whose connections must finish a request's headers in time.

    runner = GuardedAppRunner(app, header_timeout_s=10.0, handler_cancellation=True)

aiohttp bounds an idle connection (`keepalive_timeout`) but not one that has started a request:
a client that sends half its headers, or one byte of them every few seconds, held its connection
(and a file descriptor, and the parser's buffer) for as long as it liked. Here the time from the
first byte of a request to its last header is at most `header_timeout_s`; past it the connection
gets `408 Request Timeout` and is closed (no route is known yet, so no dialect's envelope: the
status line says it all). The body is bounded by whoever reads it (infra/json_body.py's
`timeout_s`). One warning line per closed connection, no traceback.

A request the parser refuses (a header over aiohttp's 8,190-byte limit, a malformed line) is
answered by the caller's `error_answer` in the route's own envelope (431, 414, 415 for a br or
zstd body whose decoder is not installed, or 400; the path is read from the request's first
bytes), with one warning line, where aiohttp logged a traceback
per request and answered text/plain; a body aiohttp fails to decode while discarding it (a bad
gzip body on a route that did not read it) is one warning line too.

A request whose answer leaves the rest of a compressed body unread (a refusal: 413, 401, ...)
has that rest abandoned (`abandoning_unread_body`, called by the app's middleware on each
answer, which makes the handler `abandon_body`): the socket is no
longer read, where aiohttp's lingering close read and inflated it for up to 10 s to discard it,
on the event loop (an 8 MB gzip body of zeros: ~6 s of CPU after its 413); the connection closes
once the lingering time is over, the answer delivered.

This reaches into aiohttp's RequestHandler (its request count, message queue and `_ErrInfo`,
pinned by the version in pyproject.toml); tests/gateway/web/test_slow_clients.py and
test_parser_refusals.py fail if a release changes them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler, RequestPayloadError, _ErrInfo

from infra.json_body import undecodable_encoding

log = logging.getLogger("aigw.http")
_TIMEOUT_ANSWER = (b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n"
                   b"\r\n")


# (path, status, code, message) -> the answer in the route's own error envelope
ErrorAnswer = Callable[[str, int, str, str], web.Response]
_HEAD_PREFIX_BYTES = 512  # of a request's first bytes, kept to name its path in an error


class _GuardedHandler(RequestHandler):
    __slots__ = ("_error_answer", "_error_head", "_head", "_header_timeout_s", "_header_timer",
                 "_is_body_abandoned", "_last_payload")

    def __init__(self, *args: Any, header_timeout_s: float, error_answer: ErrorAnswer | None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._error_answer = error_answer
        self._header_timer: asyncio.TimerHandle | None = None
        self._last_payload: Any = None  # the body stream of the newest request parsed
        self._head = b""  # the first bytes of the request being received
        self._error_head = b""  # ... of the request the parser refused
        self._is_body_abandoned = False  # the rest of the request's body is not read

    def data_received(self, data: bytes) -> None:
        num_requests = self._request_count
        between_requests = self._last_payload is None or self._last_payload.is_eof()
        if between_requests and len(self._head) < _HEAD_PREFIX_BYTES:
            self._head += data[:_HEAD_PREFIX_BYTES]
        super().data_received(data)
        if self._request_count != num_requests:  # a request's headers are complete (or refused)
            message, self._last_payload = (self._messages[-1] if self._messages
                                           else (None, None))
            if isinstance(message, _ErrInfo):
                self._error_head = self._head
            self._head = b""
            if self._header_timer is not None:  # (_cancel_header_timer's, inline: per request)
                self._header_timer.cancel()
                self._header_timer = None
        elif data and self._header_timer is None and between_requests:
            # bytes of a request whose headers have not all come (not of a body)
            self._header_timer = self._loop.call_later(self._header_timeout_s,
                                                       self._on_header_timeout)

    def abandon_body(self) -> None:
        """Read no more of this connection: the rest of the request's body is not wanted (its
        answer refused it, and says the connection closes). aiohttp's lingering close then
        waits its `lingering_time` for bytes that no longer come, and closes."""
        self._is_body_abandoned = True
        self.pause_reading()

    def resume_reading(self, resume_parser: bool = True) -> None:
        if not self._is_body_abandoned:  # (flow control resumes as the lingering close drains)
            super().resume_reading(resume_parser)

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """A request the parser refused: one warning line and the route's envelope (431 for a
        header over the limit, 414 for a request line over it, 415 for a Content-Encoding not
        decoded here, else 400), not aiohttp's traceback and text/plain."""
        if self._error_answer is None or not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        if request.writer.output_size > 0:
            raise ConnectionError("a response has started: no error answer can follow it")
        line, _, _ = self._error_head.partition(b"\r\n")
        parts = line.split(b" ")
        path = parts[1].decode("latin-1") if len(parts) > 1 else "/"
        refusal = (undecodable_encoding(_header(self._error_head, b"content-encoding") or "?")
                   if isinstance(exc, ContentEncodingError) else None)
        if refusal is not None:  # br or zstd, their decoder not installed: not the client's fault
            status, code, text = 415, "unsupported_media_type", refusal
        elif isinstance(exc, LineTooLong):
            status, code = ((414, "uri_too_long") if b"\r\n" not in self._error_head
                            else (431, "request_header_fields_too_large"))
            text = ("the request line is too long" if status == 414
                    else "a request header is too long")
        else:
            status, code, text = 400, "bad_request", f"the request is malformed: {exc.message}"
        log.warning("refused a request from %s to %s: %s", request.remote, path[:120],
                    f"{status} {code}")
        answer = self._error_answer(path, status, code, text[:300])
        answer.force_close()
        return answer

    def log_exception(self, *args: Any, **kwargs: Any) -> None:
        """A body aiohttp could not decode while discarding it (a bad gzip body on a route that
        did not read it): one line. Anything else: aiohttp's own log, traceback included."""
        exc = kwargs.get("exc_info")
        if isinstance(exc, HttpProcessingError | RequestPayloadError):
            log.warning("%s: %s: %s", args[0] if args else "request error", type(exc).__name__,
                        str(exc)[:200])
            return
        super().log_exception(*args, **kwargs)

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


def abandoning_unread_body(request: web.BaseRequest,
                           response: web.StreamResponse) -> web.StreamResponse:
    """`response`; when it leaves a compressed request body unread (a refusal: too large, no
    credential, an unknown route, ...), it says the connection closes and the rest of the body
    is never read (`abandon_body`, under a GuardedAppRunner): aiohttp's lingering close would
    inflate it to discard it, up to ~1,000x its bytes, on the event loop. A middleware calls
    this on every answer it returns."""
    encoding = request.headers.get("Content-Encoding")
    if (encoding is None or encoding.strip().lower() in ("", "identity")
            or request.content.is_eof()):
        return response
    if not response.prepared:
        response.force_close()
    protocol = request.protocol
    if isinstance(protocol, _GuardedHandler):
        protocol.abandon_body()
    return response


def _header(head: bytes, name: bytes) -> str | None:
    """Header `name` (lowercase) of a request's first bytes, if they hold it."""
    for line in head.split(b"\r\n")[1:]:
        key, sep, value = line.partition(b":")
        if sep and key.strip().lower() == name:
            return value.strip().decode("latin-1")
    return None


class _GuardedServer(web.Server):
    def __init__(self, *args: Any, header_timeout_s: float, error_answer: ErrorAnswer | None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._error_answer = error_answer

    def __call__(self) -> RequestHandler:
        return _GuardedHandler(self, loop=self._loop, header_timeout_s=self._header_timeout_s,
                               error_answer=self._error_answer, **self._kwargs)


class GuardedAppRunner(web.AppRunner):
    """`web.AppRunner` with a request-header deadline on every connection, and requests the
    parser refuses answered by `error_answer` (the route's envelope) with one log line."""

    def __init__(self, app: web.Application, *, header_timeout_s: float,
                 error_answer: ErrorAnswer | None = None, **kwargs: Any) -> None:
        if not header_timeout_s > 0:
            raise ValueError(f"header_timeout_s must be > 0, not {header_timeout_s}")
        super().__init__(app, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._error_answer = error_answer

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()  # the app's startup runs here
        return _GuardedServer(
            server.request_handler, request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation, loop=server._loop,
            header_timeout_s=self._header_timeout_s, error_answer=self._error_answer,
            **server._kwargs)
