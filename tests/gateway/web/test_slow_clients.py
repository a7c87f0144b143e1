"""Slow clients on real sockets: a request's headers must arrive within the header timeout and
its body within the body timeout, however the bytes trickle; a well-behaved keep-alive client is
untouched."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import orjson
import pytest

from gateway.settings import GatewaySettings
from tests.gateway.conftest import MODEL, GatewayServer

HEADER_TIMEOUT_S = 0.5
BODY_TIMEOUT_S = 1.0
CHAT = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})


@pytest.fixture
def gateway_url(serve_gateway: GatewayServer) -> str:
    """An open gateway (no model endpoints needed: the bodies never get that far), run by the
    runner `aigw serve` uses."""
    return serve_gateway(GatewaySettings(
        auth_enabled=False, client_header_timeout_s=HEADER_TIMEOUT_S,
        client_body_timeout_s=BODY_TIMEOUT_S, drain_timeout_s=1.0,
        models=[{"name": MODEL, "endpoints": ["http://127.0.0.1:9"]}]))


def _connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=5)
    return sock


def _read_until_closed(sock: socket.socket, budget_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes (or `budget_s` passes), and when it closed."""
    started = time.monotonic()
    received = b""
    sock.settimeout(budget_s)
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except TimeoutError:
        return received, float("inf")
    return received, time.monotonic() - started


def test_half_a_request_header_is_answered_408_and_closed(gateway_url: str) -> None:
    with _connect(gateway_url) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Ty")
        received, closed_after_s = _read_until_closed(sock, 5.0)
    assert received.startswith(b"HTTP/1.1 408 ")
    assert HEADER_TIMEOUT_S * 0.8 <= closed_after_s < HEADER_TIMEOUT_S + 1.0


def test_headers_trickled_a_byte_at_a_time_do_not_extend_the_deadline(gateway_url: str) -> None:
    header = b"GET /health HTTP/1.1\r\nHost: test\r\nX-Slow: " + b"a" * 100
    with _connect(gateway_url) as sock:
        started = time.monotonic()
        try:
            for byte in header:
                sock.sendall(bytes([byte]))
                time.sleep(0.05)
        except OSError:  # closed under us: what we want
            pass
        received, _ = _read_until_closed(sock, 5.0)
        closed_after_s = time.monotonic() - started
    assert received.startswith(b"HTTP/1.1 408 ")
    assert closed_after_s < HEADER_TIMEOUT_S + 1.5


def test_a_body_that_stops_arriving_is_a_408_in_the_dialects_envelope(gateway_url: str) -> None:
    for path, envelope in (("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic")):
        with _connect(gateway_url) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json"
                         f"\r\nContent-Length: {len(CHAT)}\r\n\r\n".encode() + CHAT[:10])
            started = time.monotonic()
            received = sock.recv(65536)  # (then aiohttp lingers, reading what else comes, 10 s)
            answered_after_s = time.monotonic() - started
        head, _, body = received.partition(b"\r\n\r\n")
        assert b"\r\nConnection: close" in head
        assert head.startswith(b"HTTP/1.1 408 "), received
        payload = orjson.loads(body)
        assert payload["error"]["type"]
        assert (payload.get("type") == "error") == (envelope == "anthropic")
        assert BODY_TIMEOUT_S * 0.8 <= answered_after_s < BODY_TIMEOUT_S + 1.0


def test_a_keep_alive_client_sends_requests_slower_than_the_header_timeout(
        gateway_url: str) -> None:
    """Idle time between requests is keep-alive's, not the header deadline's, and a body that
    arrives in time is not cut by the header deadline."""
    with _connect(gateway_url) as sock:
        for _ in range(3):
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
            answer = sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200 "), answer
            time.sleep(HEADER_TIMEOUT_S * 1.5)
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: "
                     f"application/json\r\nContent-Length: {len(CHAT) + 6}\r\n\r\n".encode())
        time.sleep(HEADER_TIMEOUT_S * 1.2)  # the body comes late, but within its own timeout
        sock.sendall(CHAT[:-1] + b',"n":0}')
        answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 400 "), answer  # n 0 is refused: the body was read
