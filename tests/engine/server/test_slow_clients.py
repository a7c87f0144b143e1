"""Slow clients of a replica, on real sockets and the runner `aigw replica` uses: request headers
within `client_header_timeout_s`, a body within `client_body_timeout_s` (408 in the envelope),
and a caller without the credential is refused before its body is waited for."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
from aiohttp import web

from engine.server.app import create_runner
from engine.server.settings import ReplicaServerSettings
from tests.engine.server.fakes import FakeEngine

HEADER_TIMEOUT_S = 0.5
BODY_TIMEOUT_S = 0.8
SECRET = "slow-client-secret"


@pytest.fixture
def replica_url() -> Iterator[str]:
    settings = ReplicaServerSettings(secret=SECRET, client_header_timeout_s=HEADER_TIMEOUT_S,
                                     client_body_timeout_s=BODY_TIMEOUT_S)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[web.AppRunner, str]:
        runner = create_runner(FakeEngine(), settings, shutdown_timeout_s=1.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    runner, url = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    yield url
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def _exchange(url: str, data: bytes, budget_s: float = 5.0) -> tuple[bytes, float]:
    """Send `data`, then read until the server closes; what it sent and when it closed."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=budget_s) as sock:
        sock.sendall(data)
        started, received = time.monotonic(), b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except TimeoutError:
            return received, float("inf")
        return received, time.monotonic() - started


def test_half_a_request_header_is_answered_408_and_closed(replica_url: str) -> None:
    received, closed_after_s = _exchange(replica_url, b"GET /kv/events HTTP/1.1\r\nHost: x\r\nAuth")
    assert received.startswith(b"HTTP/1.1 408 ")
    assert HEADER_TIMEOUT_S * 0.8 <= closed_after_s < HEADER_TIMEOUT_S + 2.0


def test_a_body_that_stops_arriving_is_408_in_the_envelope_and_closed(replica_url: str) -> None:
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}\r\n"
            f"Content-Type: application/json\r\nContent-Length: 400\r\n\r\n").encode()
    parts = urlsplit(replica_url)
    with socket.create_connection((parts.hostname, parts.port), timeout=5) as sock:
        sock.sendall(head + b'{"model": "fake-')
        started = time.monotonic()
        answer = sock.recv(65536)
        answered_after_s = time.monotonic() - started
    # (aiohttp then reads and drops what is left of the body for up to 10 s before it closes)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b"connection: close" in answer.lower()
    assert b'"code":"request_timeout"' in answer.replace(b" ", b"")
    assert BODY_TIMEOUT_S * 0.8 <= answered_after_s < BODY_TIMEOUT_S + 2.0


def test_a_caller_without_the_credential_is_refused_before_its_body_is_waited_for(
        replica_url: str) -> None:
    head = (b"POST /kv/reset HTTP/1.1\r\nHost: x\r\nContent-Length: 400\r\nConnection: close"
            b"\r\n\r\n")
    parts = urlsplit(replica_url)
    with socket.create_connection((parts.hostname, parts.port), timeout=5) as sock:
        sock.sendall(head + b"{")
        started = time.monotonic()
        first = sock.recv(65536)
    assert first.startswith(b"HTTP/1.1 401 ") and time.monotonic() - started < BODY_TIMEOUT_S


def test_the_timeouts_are_read_from_the_gateways_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIGW_CLIENT_HEADER_TIMEOUT_S", "3.5")
    monkeypatch.setenv("AIGW_CLIENT_BODY_TIMEOUT_S", "7")
    settings = ReplicaServerSettings.from_env()
    assert (settings.client_header_timeout_s, settings.client_body_timeout_s) == (3.5, 7.0)
    monkeypatch.setenv("AIGW_KEEPALIVE_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="AIGW_KEEPALIVE_TIMEOUT_S"):
        ReplicaServerSettings.from_env()
    with pytest.raises(ValueError, match="client_body_timeout_s"):
        ReplicaServerSettings(client_body_timeout_s=0)
