"""`LeanTransport`: the gateway's upstream HTTP/1.1 client, on asyncio protocols with httptools'
response parser (the parser uvicorn uses), keep-alive connections pooled per origin.

Why not aiohttp's client: on the gateway's hot path a call through `ClientSession.request` (URL and
header normalisation, timers, traces, cookie and redirect handling the gateway never uses) costs
more CPU than the rest of the gateway's per-request work; this client writes one request head
and feeds what arrives to httptools (measured in bench/results/gateway-overhead-cpu.md).

Contract (that of `Transport`):

    send(request) --connect or reuse--> write head + body --> headers arrive --> UpstreamResponse
    response.read() / lines() / line_batches()   the body, once
    response.release()   the caller has what it wants: the connection is reused once its answer
                         has ended (a stream's last bytes may still be on the way), dropped if
                         that takes longer than RELEASE_GRACE_S
    response.close()     abort: an answer not wholly received drops its connection at once (this
                         is how a disconnected client cancels its upstream request)

Connections: one request at a time each; idle ones are kept per origin (newest reused first, at
most `max_idle_per_origin`, closed after `keepalive_timeout_s` idle). A reused connection that
fails before a single byte of answer (the upstream closed it while idle) is replaced by a fresh
one once. Errors: refused or reset connections raise `UpstreamUnavailable`, a connect that takes
longer than `request.connect_timeout_s` raises `UpstreamTimeout`; an answer that breaks off raises
`UpstreamUnavailable` from the body methods. There is no read timeout, as before: a stalled
upstream is the caller's to cancel. Bodies are read with backpressure: past READ_HIGH_WATER_BYTES
not yet taken by the caller, the socket stops being read.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import ssl
import time
from collections.abc import AsyncIterator, Callable
from functools import lru_cache
from typing import NamedTuple, NoReturn
from urllib.parse import urlsplit

import httptools

from gateway.request.errors import UpstreamAnswerTooLarge, UpstreamTimeout, UpstreamUnavailable
from gateway.upstream.transport import (
    STREAM_LINE_MAX_BYTES,
    Transport,
    UpstreamRequest,
    UpstreamResponse,
    too_large_message,
)

log = logging.getLogger("aigw.gateway")

READ_HIGH_WATER_BYTES = 256 * 1024
RELEASE_GRACE_S = 1.0
CONNECT_WARNING_INTERVAL_S = 60.0  # one "cannot reach" warning per origin this often, at most
_MAX_WARNED_ORIGINS = 1024


class _Target(NamedTuple):
    """What a URL resolves to, parsed once per distinct URL."""

    origin: str  # the pool key: scheme://host:port
    host: str
    port: int
    is_tls: bool
    head_prefix: str  # " <path?query> HTTP/1.1\r\nhost: <host[:port]>\r\nuser-agent: aigw\r\n"


@lru_cache(maxsize=1024)
def _target(url: str) -> _Target:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UpstreamUnavailable("upstream failed: unsupported URL")
    is_tls = parts.scheme == "https"
    port = parts.port or (443 if is_tls else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host = parts.netloc.rpartition("@")[2]  # never the URL's user:password
    return _Target(f"{parts.scheme}://{parts.hostname}:{port}", parts.hostname, port, is_tls,
                   f" {path} HTTP/1.1\r\nhost: {host}\r\nuser-agent: aigw\r\n")


def _request_head(request: UpstreamRequest, target: _Target) -> bytes:
    fields = [f"{name}: {value}\r\n" for name, value in request.headers.items()]
    block = "".join(fields)
    # a CR or LF inside a name or value (header injection) would add lines
    if block.count("\n") != len(fields) or block.count("\r") != len(fields):
        raise ValueError("upstream request header contains a line break")
    length = f"content-length: {len(request.body)}\r\n" if request.body is not None else ""
    return f"{request.method}{target.head_prefix}{length}{block}\r\n".encode("latin-1")


class _UnaskedAnswer(Exception):
    """Raised from a parser callback to stop at an answer that follows the one requested."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection and the answer in flight on it (the httptools callbacks fill it).

    State of the current answer: `headers_ready` resolves when the status and headers have arrived
    (or fails); `body_chunks` holds body bytes not yet taken; `is_complete` once the answer has
    ended; `error` once the connection broke before that. `waiter` is the one reader waiting for
    more body.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.is_closed = False
        self.is_idle = False  # in the pool: nothing may arrive until the next request
        self.is_paused = False
        self.idle_since_s = 0.0
        self._start_answer()

    def _start_answer(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.headers_ready: asyncio.Future[None] = self.loop.create_future()
        self.body_chunks: list[bytes] = []
        self.num_buffered_bytes = 0
        self.num_received_bytes = 0
        self.is_complete = False
        self.is_interim = False  # a 1xx answer is being parsed: the requested one follows it
        self.is_reading_all = False
        self.error: Exception | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.on_complete: Callable[[], None] | None = None  # release(): reuse once the answer ends

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.is_idle:  # bytes nobody asked for: the connection can't be trusted with a request
            log.warning("upstream sent %d bytes on an idle connection", len(data))
            self.close()
            return
        self.num_received_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError:  # on_message_begin: a second answer
            log.warning("upstream sent an answer nobody asked for")
            self.close()  # the answer already received stays readable
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:  # (not a subclass)
            log.warning("upstream sent a malformed answer: %r", exc)
            self._fail(UpstreamUnavailable("upstream failed: malformed answer"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_closed = True
        if self.is_complete:
            return
        # an answer with neither content-length nor chunked encoding ends when the connection does
        if (self.headers_ready.done() and self.error is None
            and "content-length" not in self.headers
                and "chunked" not in self.headers.get("transfer-encoding", "").lower()):
            self.on_message_complete()
            return
        if exc is not None:
            log.warning("upstream connection lost: %r", exc)
        self._fail(UpstreamUnavailable("upstream failed: the connection closed"))

    def pause_writing(self) -> None:  # request bodies are written whole; nothing to pause
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        # one request, one answer: what follows it was not asked for (is_idle: release() pooled the
        # connection from inside this very feed, its answer's end and the unasked bytes in one read)
        if self.is_complete or self.is_idle:
            raise _UnaskedAnswer

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if 100 <= self.status < 200:  # informational (an unasked 100 Continue, 103 Early Hints)
            self.is_interim = True
            self.headers.clear()
            return
        if not self.headers_ready.done():
            self.headers_ready.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.body_chunks.append(body)
        self.num_buffered_bytes += len(body)
        if (self.num_buffered_bytes > READ_HIGH_WATER_BYTES and not self.is_reading_all
                and not self.is_paused and self.transport is not None):
            self.is_paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.is_interim:  # the end of a 1xx answer: the requested answer is still to come
            self.is_interim = False
            return
        self.is_complete = True
        if not self.parser.should_keep_alive():
            self.close()
        self._wake()
        if self.on_complete is not None:
            callback, self.on_complete = self.on_complete, None
            callback()

    # -- used by the response
    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: Exception) -> None:
        self.error = error
        if not self.headers_ready.done():
            self.headers_ready.set_exception(error)
            self.headers_ready.exception()  # retrieved: a send() cancelled meanwhile never reads it
        self._wake()

    def resume_reading(self) -> None:
        if self.is_paused and self.transport is not None:
            self.is_paused = False
            self.transport.resume_reading()

    async def wait_for_body(self) -> None:
        """Until more body, the end of the answer or an error."""
        self.resume_reading()
        self.waiter = self.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def take_body(self) -> bytes:
        data = b"".join(self.body_chunks) if len(self.body_chunks) != 1 else self.body_chunks[0]
        self.body_chunks.clear()
        self.num_buffered_bytes = 0
        return data

    def close(self) -> None:
        self.is_closed = True
        if self.transport is not None:
            self.transport.close()


def _check_line(pending: bytes) -> None:
    """A streamed line still without its newline past STREAM_LINE_MAX_BYTES: the stream fails
    (a cut stream, billed as one) rather than buffer an endless line."""
    if len(pending) > STREAM_LINE_MAX_BYTES:
        raise UpstreamUnavailable(f"upstream failed: a stream line is over "
                                  f"{STREAM_LINE_MAX_BYTES} bytes")


def _content_length(headers: dict[str, str]) -> int:
    """The announced body length; -1 when none (or not a number: the parser judges that)."""
    value = headers.get("content-length", "")
    return int(value) if value.isdigit() else -1


class _Pool(collections.deque[_Connection]):
    """The idle connections of one origin, newest last."""

    is_retired = False  # aclose() dropped it: an answer ending after that closes its connection


class _LeanResponse(UpstreamResponse):
    __slots__ = ("status", "headers", "_connection", "_transport", "_pool", "_is_done")

    def __init__(self, connection: _Connection, transport: LeanTransport, pool: _Pool) -> None:
        self.status = connection.status
        self.headers = connection.headers
        self._connection = connection
        self._transport = transport
        self._pool = pool
        self._is_done = False

    async def read(self, max_bytes: int | None = None) -> bytes:
        connection = self._connection
        limit = -1 if max_bytes is None else max_bytes
        if limit >= 0 and _content_length(connection.headers) > limit:
            self._refuse_too_large(limit)  # announced too large: not one byte of it is read
        connection.is_reading_all = True
        while not connection.is_complete:
            if connection.error is not None:
                raise UpstreamUnavailable("upstream failed: the answer broke "
                                          "off") from connection.error
            if 0 <= limit < connection.num_buffered_bytes:
                self._refuse_too_large(limit)
            await connection.wait_for_body()
        if 0 <= limit < connection.num_buffered_bytes:
            self._refuse_too_large(limit)
        body = connection.take_body()
        self.release()
        return body

    def _refuse_too_large(self, max_bytes: int) -> NoReturn:
        """Drop what came of the answer and its connection (reused only when it had ended)."""
        self._connection.take_body()
        self.close()
        raise UpstreamAnswerTooLarge(too_large_message(max_bytes))

    async def lines(self) -> AsyncIterator[bytes]:
        pending = b""
        async for data in self._chunks():
            *complete, pending = (pending + data).split(b"\n")
            for line in complete:
                yield line + b"\n"
            _check_line(pending)
        if pending:
            yield pending

    async def line_batches(self) -> AsyncIterator[list[bytes]]:
        pending = b""
        async for data in self._chunks():
            *complete, pending = (pending + data).split(b"\n")
            if complete:
                yield complete
            _check_line(pending)
        if pending:
            yield [pending]

    async def _chunks(self) -> AsyncIterator[bytes]:
        connection = self._connection
        while True:
            if connection.body_chunks:
                yield connection.take_body()
            elif connection.is_complete:
                return
            elif connection.error is not None:
                raise UpstreamUnavailable("upstream failed: the stream broke "
                                          "off") from connection.error
            else:
                await connection.wait_for_body()

    def release(self) -> None:
        if self._is_done:
            return
        self._is_done = True
        connection = self._connection
        if connection.is_complete:
            self._transport.put_back(connection, self._pool)
            return
        if connection.error is not None or connection.is_closed:
            connection.close()
            return
        # the answer's last bytes (a stream's closing chunk) are still on the way; nobody reads
        # them, so they must not pause the socket
        connection.is_reading_all = True
        connection.resume_reading()
        timer = connection.loop.call_later(RELEASE_GRACE_S, connection.close)

        def put_back() -> None:
            timer.cancel()
            self._transport.put_back(connection, self._pool)

        connection.on_complete = put_back

    def close(self) -> None:
        if self._is_done:
            return
        if self._connection.is_complete:
            self.release()
            return
        self._is_done = True
        self._connection.close()


class LeanTransport(Transport):
    def __init__(self, *, keepalive_timeout_s: float = 60.0, max_idle_per_origin: int = 1024,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self._pools: dict[str, _Pool] = {}  # origin -> idle connections
        self._keepalive_timeout_s = keepalive_timeout_s
        self._max_idle_per_origin = max_idle_per_origin
        self._ssl_context = ssl_context
        # origin -> when its last connect failure was logged as a warning: a down endpoint is
        # health-checked every few seconds, and each check would add a warning line
        self._connect_warned_at: dict[str, float] = {}

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        target = _target(request.url)
        head = _request_head(request, target)
        pool = self._pools.get(target.origin)
        if pool is None:
            pool = self._pools[target.origin] = _Pool()
        connection = self._idle_connection(pool)
        if connection is not None:
            try:
                return await self._exchange(connection, head, request.body, pool)
            except UpstreamUnavailable:
                if connection.num_received_bytes:
                    raise
                # the upstream closed the idle connection before reading this request: a fresh one
        connection = await self._connect(target, request.connect_timeout_s)
        return await self._exchange(connection, head, request.body, pool)

    def _idle_connection(self, pool: _Pool) -> _Connection | None:
        now_s = time.monotonic()
        while pool:
            connection = pool.pop()
            connection.is_idle = False
            if (not connection.is_closed
                and now_s - connection.idle_since_s < self._keepalive_timeout_s):
                return connection
            connection.close()
        return None

    async def _connect(self, target: _Target, connect_timeout_s: float) -> _Connection:
        loop = asyncio.get_running_loop()
        ssl_context = None
        if target.is_tls:
            if self._ssl_context is None:
                self._ssl_context = ssl.create_default_context()
            ssl_context = self._ssl_context
        try:
            async with asyncio.timeout(connect_timeout_s):
                _, connection = await loop.create_connection(
                    lambda: _Connection(loop), target.host, target.port, ssl=ssl_context,
                    server_hostname=target.host if ssl_context else None)
        except TimeoutError as exc:
            self._log_connect_failure(target.origin, "connecting to %s timed out", target.origin)
            raise UpstreamTimeout("upstream failed: connecting timed out") from exc
        except OSError as exc:  # details in the log, not the answer
            self._log_connect_failure(target.origin, "cannot reach %s: %r", target.origin, exc)
            raise UpstreamUnavailable("upstream failed: cannot connect") from exc
        if self._connect_warned_at.pop(target.origin, None) is not None:
            log.warning("%s is reachable again", target.origin)
        return connection

    def _log_connect_failure(self, origin: str, message: str, *args: object) -> None:
        """A warning for an origin's first failure and then once per CONNECT_WARNING_INTERVAL_S
        while it keeps failing (debug in between); its next connect says it is back."""
        now_s = time.monotonic()
        warned_at = self._connect_warned_at.get(origin)
        if warned_at is not None and now_s - warned_at < CONNECT_WARNING_INTERVAL_S:
            log.debug(message, *args)
            return
        if warned_at is None and len(self._connect_warned_at) >= _MAX_WARNED_ORIGINS:
            self._connect_warned_at.clear()
        self._connect_warned_at[origin] = now_s
        log.warning(message + " (repeats logged once a minute until it answers)", *args)

    async def _exchange(self, connection: _Connection, head: bytes, body: bytes | None,
                        pool: _Pool) -> UpstreamResponse:
        transport = connection.transport
        assert transport is not None
        if body:
            transport.writelines((head, body))
        else:
            transport.write(head)
        try:
            await connection.headers_ready
        except asyncio.CancelledError:
            connection.close()
            raise
        return _LeanResponse(connection, self, pool)

    def put_back(self, connection: _Connection, pool: _Pool) -> None:
        """An answer has ended and its reader is done: the connection serves the next request."""
        if connection.is_closed or pool.is_retired or len(pool) >= self._max_idle_per_origin:
            connection.close()
            return
        connection._start_answer()
        # the answer may have ended in the very read that paused the socket: a paused idle
        # connection would see neither the next answer nor the upstream closing it
        connection.resume_reading()
        connection.is_idle = True
        connection.idle_since_s = now_s = time.monotonic()
        # the oldest idle connections (left of the pool) are reached by no call while newer ones
        # serve them all: those past their keepalive are closed here, not kept open for ever
        while pool and now_s - pool[0].idle_since_s >= self._keepalive_timeout_s:
            pool.popleft().close()
        pool.append(connection)

    async def aclose(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.is_retired = True
            while pool:
                pool.pop().close()
