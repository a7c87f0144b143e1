"""Upstream I/O behind one method: `Transport.send(UpstreamRequest) -> UpstreamResponse`.

Backends never touch an HTTP client directly; tests hand them a `MockTransport`. The one real
transport is `LeanTransport` (gateway/upstream/lean_transport.py: asyncio protocols + httptools,
keep-alive connections pooled per origin), chosen over aiohttp's `ClientSession` for its CPU cost
a request (docs/performance.md, "Gateway overhead"), and the gateway's only HTTP client: model
calls, health and load probes, the KV event consumers (gateway/routing/events_consumer.py), the
dashboard's fetches from replicas and budget webhooks (gateway/metering/alerts.py) all go
through it. Connection failures surface as `UpstreamUnavailable`, connect timeouts as
`UpstreamTimeout`; their messages reach clients, so they say "upstream failed: <short reason>" and
the URL and exception details go to the log only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.request.errors import UpstreamAnswerTooLarge

if TYPE_CHECKING:
    from gateway.request.observer import UpstreamCallObserver


@dataclass(slots=True)  # (not frozen: a frozen init costs a setattr call per field)
class UpstreamRequest:
    """One upstream call. `headers` belongs to this request: the request's observer may add to it
    (the trace context), so each request gets a dict of its own."""

    method: str
    url: str
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    connect_timeout_s: float = 5.0


ERROR_BODY_MAX_BYTES = 1024 * 1024  # an upstream's 4xx/5xx body: read for its message alone
PROBE_BODY_MAX_BYTES = 16 * 1024 * 1024  # health, /v1/models, /metrics answers
STREAM_LINE_MAX_BYTES = 64 * 1024 * 1024  # one line of a streamed answer (an SSE `data:` line)


async def read_error_body(response: UpstreamResponse) -> bytes:
    """An error answer's body for its message, up to ERROR_BODY_MAX_BYTES; past it, b""
    (the status alone says what failed)."""
    try:
        return await response.read(ERROR_BODY_MAX_BYTES)
    except UpstreamAnswerTooLarge:
        return b""


def too_large_message(max_bytes: int) -> str:
    """What a client is told of an answer over `max_bytes` (the setting
    `max_upstream_answer_bytes`)."""
    return f"upstream failed: the answer is over {max_bytes} bytes (max_upstream_answer_bytes)"


class UpstreamResponse(ABC):
    """An upstream answer whose body is read once, either whole or line by line; close() always."""

    status: int
    headers: Mapping[str, str]

    @abstractmethod
    async def read(self, max_bytes: int | None = None) -> bytes:
        """The whole body; one over `max_bytes` (when given) raises `UpstreamAnswerTooLarge`
        and drops the connection, without buffering more than about that."""

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
        """Drop the connection if the body was not fully read (this is how an upstream is
        aborted)."""

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


def send_observed(transport: Transport, request: UpstreamRequest,
                  call: UpstreamCallObserver | None) -> Awaitable[UpstreamResponse]:
    """`transport.send(request)`, telling `call` (the request's observer's, when it observes the
    call: gateway/request/observer.py) that it was answered, or that it failed. Without a `call`
    it is the transport's own coroutine (no layer of ours on the path)."""
    if call is None:
        return transport.send(request)
    return _send_telling(transport, request, call)


async def _send_telling(transport: Transport, request: UpstreamRequest,
                        call: UpstreamCallObserver) -> UpstreamResponse:
    try:
        response = await transport.send(request)
    except BaseException as exc:
        call.on_failed(exc)
        raise
    call.on_answered(response.status)
    return response


class MockResponse(UpstreamResponse):
    """A canned answer for tests: `chunks` are yielded as lines (split on newlines)."""

    def __init__(self, status: int, body: bytes = b"",
                 headers: Mapping[str, str] | None = None) -> None:
        self.status = status
        self.headers = dict(headers or {})
        self._body = body
        self.closed = False

    async def read(self, max_bytes: int | None = None) -> bytes:
        if max_bytes is not None and len(self._body) > max_bytes:
            self.close()
            raise UpstreamAnswerTooLarge(too_large_message(max_bytes))
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
