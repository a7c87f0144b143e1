"""Requests the HTTP layer refuses before a handler runs (infra/http_server.py under the gateway's
server): a header over aiohttp's limit is a 431, a body its Content-Encoding does not describe a
400; each gets one warning line, no traceback, and the route's own error envelope, and the
connection is announced closed rather than dropped under the client's next request. What a
refusal leaves of a compressed body is never read (nor inflated)."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from gateway.settings import GatewaySettings
from tests.gateway.conftest import MODEL, Gateway, GatewayServer, LoopThread, start_runner
from tests.raw_http import post_gzip_of_zeros, send_raw

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


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/nowhere"])
def test_the_rest_of_a_refused_compressed_body_is_never_inflated(loop_thread: LoopThread,
                                                                  path: str) -> None:
    """aiohttp reads what a handler left of a body to discard it (its lingering close), and a
    compressed body is inflated as it is read: a 4 MB gzip body of zeros refused at once (413
    over max_body_bytes, 404) went on to inflate to GiBs on the event loop (an 8 MB one: ~6 s
    of CPU after its 413). Now the connection closes, the rest never read."""
    from gateway.web.app import create_app
    from gateway.web.server import parser_error_answer
    from infra.http_server import GuardedAppRunner

    bodies: list[Any] = []

    @web.middleware
    async def keep_body(request: web.Request, handler: Any) -> web.StreamResponse:
        bodies.append(request.content)
        return await handler(request)  # type: ignore[no-any-return]

    settings = GatewaySettings(auth_enabled=False, max_body_bytes=1 << 20,
                               models=[{"name": MODEL, "endpoints": ["http://127.0.0.1:9"]}])
    app = create_app(settings)
    app.middlewares.insert(0, keep_body)
    runner = GuardedAppRunner(app, header_timeout_s=10, error_answer=parser_error_answer,
                              lingering_time=1.0, access_log=None)
    url = loop_thread.run(start_runner(runner))
    try:
        answer = post_gzip_of_zeros(url, path, 4096)  # 4 MB -> 4 GiB
        assert answer.startswith(b"HTTP/1.1 413" if "chat" in path else b"HTTP/1.1 404"), answer
        assert b"connection: close" in answer.lower()
        _assert_envelope(answer.partition(b"\r\n\r\n")[2], anthropic=False)
        (content,) = bodies
        # inflated: what came before the answer (~1 MiB); 1 s of lingering inflated 100+ MiB
        assert content.total_bytes < 8 << 20, content.total_bytes
    finally:
        loop_thread.run(runner.cleanup())


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/anthropic/v1/messages"])
def test_a_body_that_is_not_utf8_is_a_400_naming_the_byte(gateway_url: str, path: str) -> None:
    # a shell that sends Latin-1: "été" as e9 74 e9; orjson alone said "surrogates not allowed"
    # at char 0, whatever the byte
    body = orjson.dumps(BODIES[path]).replace(b'"hi"', '"été"'.encode("latin-1"))
    offset = body.index(b"\xe9")
    response = httpx.post(gateway_url + path, content=body)
    assert response.status_code == 400
    _assert_envelope(response.content, path.startswith("/anthropic"))
    message = response.json()["error"]["message"]
    assert f"byte {offset} (0xe9) is not UTF-8" in message and "surrogates" not in message
    assert httpx.post(gateway_url + path, content=body.decode("latin-1").encode()).status_code \
        != 400  # the same text in UTF-8 is read (no upstream here: not a 400 for the body)
