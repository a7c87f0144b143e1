"""Requests the HTTP layer refuses before a handler runs (infra/http_server.py under the gateway's
server): a header over aiohttp's limit is a 431, a body its Content-Encoding does not describe a
400; each gets one warning line, no traceback, and the route's own error envelope, and the
connection is announced closed rather than dropped under the client's next request."""

from __future__ import annotations

import logging

import httpx
import orjson
import pytest

from gateway.settings import GatewaySettings
from tests.gateway.conftest import MODEL, Gateway, GatewayServer
from tests.raw_http import send_raw

CHAT = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
BODIES = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    "/anthropic/v1/messages": {"model": MODEL, "max_tokens": 5,
                               "messages": [{"role": "user", "content": "hi"}]},
}


@pytest.fixture
def gateway_url(serve_gateway: GatewayServer) -> str:
    return serve_gateway(GatewaySettings(auth_enabled=False, drain_timeout_s=1.0,
                                         models=[{"name": MODEL, "endpoints": ["http://127.0.0.1:9"]}]))


def _assert_envelope(body: bytes, anthropic: bool) -> None:
    payload = orjson.loads(body)
    assert payload["error"]["message"] and payload["error"]["type"]
    assert (payload.get("type") == "error") == anthropic


def _no_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/anthropic/v1/messages"])
def test_an_over_long_header_is_one_warning_and_a_431_in_the_envelope(
        gateway_url: str, path: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    for _ in range(3):
        status, _, body = send_raw(gateway_url, f"POST {path} HTTP/1.1\r\nHost: t\r\n".encode()
                                   + b"X-Big: " + b"a" * 10_000 + b"\r\nConnection: close\r\n\r\n")
        assert status == 431
        _assert_envelope(body, path.startswith("/anthropic"))
    _no_tracebacks(caplog)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 3 and all(len(r.getMessage()) < 300 for r in warnings)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/models"])
def test_a_body_that_is_not_its_content_encoding_is_a_400_in_the_envelope(
        gateway_url: str, path: str, caplog: pytest.LogCaptureFixture) -> None:
    method = "GET" if path.endswith("models") else "POST"
    status, head, body = send_raw(gateway_url, (
        f"{method} {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"Content-Encoding: gzip\r\nContent-Length: {len(CHAT)}\r\nConnection: close\r\n\r\n"
    ).encode() + CHAT)
    if method == "POST":
        assert status == 400
        _assert_envelope(body, path == "/v1/messages")
    else:
        assert status == 200  # a GET does not read its body: it is answered as usual
    _no_tracebacks(caplog)


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
@pytest.mark.parametrize("path", list(BODIES))
def test_a_body_that_is_not_its_content_encoding_is_a_400_and_the_next_request_still_works(
        gateway: Gateway, path: str, encoding: str) -> None:
    with httpx.Client(base_url=gateway.url, timeout=10,
                      limits=httpx.Limits(max_connections=1)) as client:
        response = client.post(path, content=orjson.dumps(BODIES[path]),
                               headers={"content-type": "application/json",
                                        "content-encoding": encoding})
        assert response.status_code == 400, response.text
        body = response.json()
        error = body["error"]
        if "messages" in path:
            assert body["type"] == "error" and error["type"] == "invalid_request_error"
        else:
            assert error["code"] == "invalid_request" and error["type"] == "invalid_request_error"
        assert encoding in error["message"]
        assert response.headers.get("connection", "").lower() == "close"
        follow_up = client.get("/v1/models")  # a new connection, not the half-read one
        assert follow_up.status_code == 200
    assert not gateway.upstreams[0].state.request_ids
    assert not gateway.meter.settled


@pytest.mark.parametrize("encoding", ["foo", "br", "zstd", "gzip, deflate", "x-gzip"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/anthropic/v1/messages"])
def test_a_content_encoding_the_gateway_cannot_decode_is_a_415_naming_those_it_can(
        gateway_url: str, path: str, encoding: str, caplog: pytest.LogCaptureFixture) -> None:
    """`foo` (or two encodings at once, which aiohttp does not decode) was read as identity:
    the JSON underneath answered as if it were the body. br and zstd without their decoder
    installed were a 400 telling the client to install Brotli on the gateway's machine."""
    from infra.json_body import DECODABLE_ENCODINGS

    if encoding in DECODABLE_ENCODINGS:
        pytest.skip(f"{encoding} is decodable in this environment")
    body = orjson.dumps(BODIES[path])
    status, _, answer = send_raw(gateway_url, (
        f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"Content-Encoding: {encoding}\r\nContent-Length: {len(body)}\r\n"
        f"Connection: close\r\n\r\n").encode() + body)
    assert status == 415, answer
    _assert_envelope(answer, path.startswith("/anthropic"))
    message = orjson.loads(answer)["error"]["message"]
    assert repr(encoding) in message and "gzip, deflate" in message
    assert "install" not in message.lower()
    _no_tracebacks(caplog)
