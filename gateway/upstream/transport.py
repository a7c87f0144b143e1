"""Upstream I/O behind one method: `Transport.send(UpstreamRequest) -> UpstreamResponse`.

Backends never touch an HTTP client directly; tests hand them a `MockTransport`. Two real ones:
`LeanTransport` (gateway/upstream/lean_transport.py, the default: asyncio protocols + httptools) and
`AiohttpTransport` here, which keeps one pooled `ClientSession` per upstream origin (keep-alive
connections, no per-request session); `create_transport(name)` makes either.
Connection failures surface as `UpstreamUnavailable`, connect timeouts as `UpstreamTimeout`; their
messages reach clients, so they say "upstream failed: <short reason>" and the URL and exception
details go to the log only.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from urllib.parse import urlsplit

import aiohttp
from yarl import URL

from gateway.request.errors import UpstreamTimeout, UpstreamUnavailable

log = logging.getLogger("aigw.gateway")


@dataclass(slots=True)  # (not frozen: a frozen init costs a setattr call per field)
class UpstreamRequest:
    """One upstream call. `headers` belongs to this request: a transport wrapper may add to it
    (the trace context), so each request gets a dict of its own."""

    method: str
    url: str
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    connect_timeout_s: float = 5.0


class UpstreamResponse(ABC):
    """An upstream answer whose body is read once, either whole or line by line; close() always."""

    status: int
    headers: Mapping[str, str]

    @abstractmethod
    async def read(self) -> bytes: ...

    @abstractmethod
    def lines(self) -> AsyncIterator[bytes]:
        """Body lines as they arrive, each with its trailing newline (if any)."""

    async def line_batches(self) -> AsyncIterator[list[bytes]]:
        """Every complete line already received, as one batch per arrival (newlines may be
        stripped). Lets a stream coalesce what the upstream sent faster than we forward it;
        the default is one line per batch."""
        async for line in self.lines():
            yield [line]

    @abstractmethod
    def close(self) -> None:
        """Drop the connection if the body was not fully read (this is how an upstream is aborted)."""

    def release(self) -> None:
        """The caller has all it wants of a body that is ending by itself (a stream past its
        `[DONE]`): the connection may be reused once the rest arrives. The default closes."""
        self.close()


class Transport(ABC):
    @abstractmethod
    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        """Send the request; return once the status line and headers have arrived."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release pooled connections."""


class _AiohttpResponse(UpstreamResponse):
    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.headers = response.headers

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        except (aiohttp.ClientError, ConnectionError) as exc:
            log.warning("upstream body failed: %r", exc)
            raise UpstreamUnavailable("upstream failed: the answer broke off") from exc

    async def lines(self) -> AsyncIterator[bytes]:
        content = self._response.content
        try:
            while True:
                line = await content.readline()
                if not line:
                    return
                yield line
        except (aiohttp.ClientError, ConnectionError) as exc:
            log.warning("upstream stream broke: %r", exc)
            raise UpstreamUnavailable("upstream failed: the stream broke off") from exc

    async def line_batches(self) -> AsyncIterator[list[bytes]]:
        content = self._response.content
        pending = b""
        try:
            while True:
                chunk = await content.readany()
                if not chunk:
                    if pending:
                        yield [pending]
                    return
                *complete, pending = (pending + chunk).split(b"\n")
                if complete:
                    yield complete
        except (aiohttp.ClientError, ConnectionError) as exc:
            log.warning("upstream stream broke: %r", exc)
            raise UpstreamUnavailable("upstream failed: the stream broke off") from exc

    def close(self) -> None:
        self._response.close()


@lru_cache(maxsize=1024)
def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


@lru_cache(maxsize=1024)
def _parsed_url(url: str) -> URL:
    """A gateway calls few distinct URLs: each is parsed once, not per request."""
    return URL(url)


@lru_cache(maxsize=64)
def _timeout(connect_timeout_s: float) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)


class AiohttpTransport(Transport):
    def __init__(self, *, limit_per_host: int = 0, keepalive_timeout_s: float = 60.0) -> None:
        self._sessions: dict[str, aiohttp.ClientSession] = {}
        self._limit_per_host = limit_per_host
        self._keepalive_timeout_s = keepalive_timeout_s

    def _session(self, url: str) -> aiohttp.ClientSession:
        origin = _origin(url)
        session = self._sessions.get(origin)
        if session is None:
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=self._limit_per_host,
                                             keepalive_timeout=self._keepalive_timeout_s)
            # no cookie jar: a cookie one client's answer set must never ride on another's call
            session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                            timeout=aiohttp.ClientTimeout(total=None),
                                            cookie_jar=aiohttp.DummyCookieJar())
            self._sessions[origin] = session
        return session

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        try:
            response = await self._session(request.url).request(
                request.method, _parsed_url(request.url), data=request.body,
                headers=request.headers, timeout=_timeout(request.connect_timeout_s))
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            log.warning("connecting to %s timed out", request.url)
            raise UpstreamTimeout("upstream failed: connecting timed out") from exc
        except (aiohttp.ClientError, OSError) as exc:
            log.warning("cannot reach %s: %r", request.url, exc)  # details in the log, not the answer
            raise UpstreamUnavailable("upstream failed: cannot connect") from exc
        return _AiohttpResponse(response)

    async def aclose(self) -> None:
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            await session.close()


def create_transport(name: str) -> Transport:
    """"lean" or "aiohttp" (GatewaySettings.upstream_client)."""
    if name == "aiohttp":
        return AiohttpTransport()
    if name == "lean":
        from gateway.upstream.lean_transport import LeanTransport

        return LeanTransport()
    raise ValueError(f"unknown upstream client {name!r}")


class MockResponse(UpstreamResponse):
    """A canned answer for tests: `chunks` are yielded as lines (split on newlines)."""

    def __init__(self, status: int, body: bytes = b"", headers: Mapping[str, str] | None = None) -> None:
        self.status = status
        self.headers = dict(headers or {})
        self._body = body
        self.closed = False

    async def read(self) -> bytes:
        return self._body

    async def lines(self) -> AsyncIterator[bytes]:
        for line in self._body.splitlines(keepends=True):
            yield line

    def close(self) -> None:
        self.closed = True


class MockTransport(Transport):
    """Answers every request with `handler(request)`; records what was sent in `requests`."""

    def __init__(self, handler: Callable[[UpstreamRequest], Awaitable[UpstreamResponse]]) -> None:
        self._handler = handler
        self.requests: list[UpstreamRequest] = []

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        self.requests.append(request)
        return await self._handler(request)
