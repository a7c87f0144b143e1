"""LeanTransport against real sockets: an aiohttp server for ordinary answers and streams, and a
raw asyncio server where an upstream must misbehave (close idle connections, end a body at EOF,
break off, send garbage)."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp import web

from gateway.request.errors import UpstreamTimeout, UpstreamUnavailable
from gateway.upstream.lean_transport import READ_HIGH_WATER_BYTES, LeanTransport
from gateway.upstream.transport import UpstreamRequest


class _Upstream:
    """An aiohttp app that notes the connections (client ports) it served and the requests it
    saw."""

    def __init__(self) -> None:
        self.client_ports: set[int] = set()
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []
        self.disconnected = asyncio.Event()
        self.app = web.Application(middlewares=[self.note_connection])
        self.app.router.add_post("/echo", self.echo)
        self.app.router.add_get("/stream", self.stream)
        self.app.router.add_get("/big", self.big)
        self.app.router.add_get("/endless", self.endless)

    @property
    def num_connections(self) -> int:
        return len(self.client_ports)

    @web.middleware
    async def note_connection(self, request: web.Request,
                              handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                              ) -> web.StreamResponse:
        assert request.transport is not None
        self.client_ports.add(request.transport.get_extra_info("peername")[1])
        return await handler(request)

    async def echo(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.seen.append((request.method, request.path_qs,
                          {name.lower(): value for name, value in request.headers.items()}, body))
        return web.Response(body=b"echo:" + body, status=201, headers={"X-Answer": "yes"})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for index in range(5):
            await response.write(f"data: {index}\n\n".encode())
            await asyncio.sleep(0.005)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def big(self, request: web.Request) -> web.Response:
        return web.Response(body=b"x" * (4 * READ_HIGH_WATER_BYTES))

    async def endless(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        try:
            while True:
                await response.write(b"data: more\n\n")
                await asyncio.sleep(0.01)
        except (ConnectionError, asyncio.CancelledError):
            self.disconnected.set()
            raise


@asynccontextmanager
async def _serve(upstream: _Upstream,
                 ssl_context: ssl.SSLContext | None = None) -> AsyncIterator[str]:
    runner = web.AppRunner(upstream.app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"{'https' if ssl_context else 'http'}://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def _raw_server(handle: Callable[[asyncio.StreamReader,
                                        asyncio.StreamWriter], Awaitable[None]]
                      ) -> AsyncIterator[str]:
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()


RawHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def _with_upstream(scenario: Callable[[_Upstream, LeanTransport, str], Awaitable[None]],
                   server_ssl: ssl.SSLContext | None = None,
                   client_ssl: ssl.SSLContext | None = None) -> None:
    """Run `scenario(upstream, transport, url)`: a fresh _Upstream served on 127.0.0.1 (over TLS
    with `server_ssl`) and a fresh LeanTransport, closed afterwards."""
    async def main() -> None:
        upstream = _Upstream()
        transport = LeanTransport(ssl_context=client_ssl)
        try:
            async with _serve(upstream, server_ssl) as url:
                await scenario(upstream, transport, url)
        finally:
            await transport.aclose()

    asyncio.run(main())


def _with_raw_server(handle: RawHandler,
                     scenario: Callable[[LeanTransport, str], Awaitable[None]],
                     transport: LeanTransport | None = None) -> None:
    """Run `scenario(transport, url)` against a raw server answering with `handle`; the
    transport (a fresh LeanTransport unless given) is closed afterwards."""
    async def main() -> None:
        client = transport or LeanTransport()
        try:
            async with _raw_server(handle) as url:
                await scenario(client, url)
        finally:
            await client.aclose()

    asyncio.run(main())


async def _each_request(reader: asyncio.StreamReader) -> AsyncIterator[None]:
    """Once per request head the client sends, until it closes the connection."""
    while True:
        try:
            await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return
        yield


def _answer_once(raw: bytes, close: bool = True) -> RawHandler:
    """A raw server's handler: read one request head, write `raw`, then close (or keep quiet)."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(raw)
        await writer.drain()
        if close:
            writer.close()

    return handle


def test_keeps_one_connection_alive_across_calls_and_sends_what_it_was_given() -> None:
    async def scenario(upstream: _Upstream, transport: LeanTransport, url: str) -> None:
        for index in range(5):
            response = await transport.send(UpstreamRequest(
                "POST", f"{url}/echo?n={index}", f"body {index}".encode(),
                {"content-type": "application/json", "x-request-id": f"r{index}"}))
            assert response.status == 201
            assert response.headers["x-answer"] == "yes"
            assert await response.read() == f"echo:body {index}".encode()
            response.close()
        assert upstream.num_connections == 1
        method, path, headers, body = upstream.seen[3]
        assert (method, path, body) == ("POST", "/echo?n=3", b"body 3")
        assert headers["x-request-id"] == "r3" and headers["content-length"] == "6"
        assert headers["host"] == url.removeprefix("http://") and headers["user-agent"] == "aigw"

    _with_upstream(scenario)


def test_stream_lines_and_batches_arrive_whole_and_the_connection_is_reused_after_release() -> None:
    async def scenario(upstream: _Upstream, transport: LeanTransport, url: str) -> None:
        response = await transport.send(UpstreamRequest("GET", f"{url}/stream"))
        lines = [line async for line in response.lines()]
        assert lines == [b"data: 0\n", b"\n", b"data: 1\n", b"\n", b"data: 2\n", b"\n",
                         b"data: 3\n", b"\n", b"data: 4\n", b"\n", b"data: [DONE]\n", b"\n"]
        response.release()
        response = await transport.send(UpstreamRequest("GET", f"{url}/stream"))
        batches = [batch async for batch in response.line_batches()]
        data = [line for batch in batches for line in batch if line]
        assert data == [b"data: 0", b"data: 1", b"data: 2", b"data: 3", b"data: 4",
                        b"data: [DONE]"]
        response.release()
        assert upstream.num_connections == 1

    _with_upstream(scenario)


async def _leave_a_stream_at(transport: LeanTransport, url: str, first: bytes,
                             release: bool) -> None:
    """Read the stream at `url` up to its first line starting with `first`, then release the
    answer (the stream runs on, to be reused) or close it (the call is aborted)."""
    response = await transport.send(UpstreamRequest("GET", url))
    async for line in response.lines():
        if line.startswith(first):
            break
    if release:
        response.release()
    else:
        response.close()


async def _echo(transport: LeanTransport, url: str, body: bytes) -> bytes:
    return await (await transport.send(UpstreamRequest("POST", f"{url}/echo", body))).read()


def test_release_before_the_stream_ends_reuses_the_connection_once_it_does() -> None:
    async def scenario(upstream: _Upstream, transport: LeanTransport, url: str) -> None:
        await _leave_a_stream_at(transport, f"{url}/stream", b"data: 2", release=True)
        await asyncio.sleep(0.2)  # three more events and the closing chunk are on the way
        assert await _echo(transport, url, b"after") == b"echo:after"
        assert upstream.num_connections == 1

    _with_upstream(scenario)


def test_close_mid_stream_aborts_the_upstream_call() -> None:
    async def scenario(upstream: _Upstream, transport: LeanTransport, url: str) -> None:
        await _leave_a_stream_at(transport, f"{url}/endless", b"data:", release=False)
        await asyncio.wait_for(upstream.disconnected.wait(), 5)
        assert await _echo(transport, url, b"next") == b"echo:next"
        assert upstream.num_connections == 2  # the aborted connection was not reused

    _with_upstream(scenario)


def test_a_slow_reader_pauses_the_socket_and_still_gets_every_byte() -> None:
    async def scenario(upstream: _Upstream, transport: LeanTransport, url: str) -> None:
        response = await transport.send(UpstreamRequest("GET", f"{url}/big"))
        await asyncio.sleep(0.2)  # let the answer pile up unread
        connection = response._connection  # type: ignore[attr-defined]
        assert connection.num_buffered_bytes <= READ_HIGH_WATER_BYTES + 256 * 1024
        assert connection.is_paused
        total = sum(len(line) for line in [line async for line in response.lines()])
        assert total == 4 * READ_HIGH_WATER_BYTES
        response.release()

    _with_upstream(scenario)


def test_an_idle_connection_the_upstream_closed_is_replaced_without_an_error() -> None:
    num_connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal num_connections
        num_connections += 1
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # keep-alive promised, then closed: the next call must not fail

    async def scenario(transport: LeanTransport, url: str) -> None:
        for _ in range(3):
            response = await transport.send(UpstreamRequest("GET", f"{url}/x"))
            assert await response.read() == b"ok"
            response.close()
            await asyncio.sleep(0.05)

    _with_raw_server(handle, scenario)
    assert num_connections == 3


def test_bytes_after_the_answer_retire_the_connection_instead_of_answering_the_next_call() -> None:
    num_connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal num_connections
        num_connections += 1
        index = 0
        async for _ in _each_request(reader):
            index += 1
            writer.write(f"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nr{index}".encode())
            if index == 1:  # a second, unrequested answer right behind the first
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstray")
            await writer.drain()

    async def scenario(transport: LeanTransport, url: str) -> None:
        response = await transport.send(UpstreamRequest("GET", f"{url}/x"))
        assert await response.read() == b"r1"
        await asyncio.sleep(0.1)  # the stray answer lands on the idle connection
        response = await transport.send(UpstreamRequest("GET", f"{url}/x"))
        assert await response.read() == b"r1"  # a fresh connection's first answer

    _with_raw_server(handle, scenario)
    assert num_connections == 2


def test_a_body_without_length_ends_with_the_connection() -> None:
    handle = _answer_once(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nline one\nline two")

    async def scenario(transport: LeanTransport, url: str) -> None:
        response = await transport.send(UpstreamRequest("GET", f"{url}/x"))
        assert [line async for line in response.lines()] == [b"line one\n", b"line two"]
        response.close()

    _with_raw_server(handle, scenario)


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: Chunked\r\n\r\n5\r\nhello\r\n",  # any case of "chunked"
], ids=["short_content_length", "unterminated_chunked"])
def test_an_answer_that_breaks_off_raises_upstream_unavailable(answer: bytes) -> None:
    async def scenario(transport: LeanTransport, url: str) -> None:
        response = await transport.send(UpstreamRequest("GET", f"{url}/x"))
        with pytest.raises(UpstreamUnavailable, match="broke off"):
            await response.read()
        response.close()
        response = await transport.send(UpstreamRequest("GET", f"{url}/x"))
        with pytest.raises(UpstreamUnavailable, match="broke off"):
            [line async for line in response.lines()]
        response.close()

    _with_raw_server(_answer_once(answer), scenario)


def test_garbage_or_silence_then_close_before_headers_is_upstream_unavailable() -> None:
    garbage = _answer_once(b"this is not http\r\n\r\n", close=False)
    silence = _answer_once(b"")

    async def main() -> None:
        transport = LeanTransport()
        for handle in (garbage, silence):
            async with _raw_server(handle) as url:
                with pytest.raises(UpstreamUnavailable):
                    await transport.send(UpstreamRequest("GET", f"{url}/x"))
        await transport.aclose()

    asyncio.run(main())


def test_refused_connection_and_connect_timeout_are_named() -> None:
    async def main() -> None:
        transport = LeanTransport()
        async with _raw_server(lambda r, w: asyncio.sleep(0)) as url:
            pass  # the port is free again: nothing listens there
        with pytest.raises(UpstreamUnavailable, match="cannot connect"):
            await transport.send(UpstreamRequest("GET", f"{url}/x"))
        with pytest.raises(UpstreamTimeout, match="timed out"):
            await transport.send(UpstreamRequest("GET", f"{url}/x", connect_timeout_s=0))

    asyncio.run(main())


def test_a_down_origin_is_warned_about_once_and_again_when_it_answers(
        caplog: pytest.LogCaptureFixture) -> None:
    """A down endpoint's health checks logged a warning every few seconds, forever."""
    async def main() -> None:
        transport = LeanTransport()
        async with _raw_server(lambda r, w: asyncio.sleep(0)) as url:
            pass  # the port is free again: nothing listens there
        for _ in range(3):
            with pytest.raises(UpstreamUnavailable):
                await transport.send(UpstreamRequest("GET", f"{url}/x"))
        port = int(url.rsplit(":", 1)[1])
        server = await asyncio.start_server(_answer_once(b"HTTP/1.1 204 No Content\r\n\r\n"),
                                            "127.0.0.1", port)
        try:
            assert (await transport.send(UpstreamRequest("GET", f"{url}/x"))).status == 204
        finally:
            server.close()

    with caplog.at_level("DEBUG", logger="aigw.gateway"):
        asyncio.run(main())
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "aigw.gateway"]
    assert [level for level, _ in lines] == ["WARNING", "DEBUG", "DEBUG", "WARNING"]
    assert "cannot reach" in lines[0][1] and lines[-1][1].endswith("is reachable again")


def test_a_line_break_in_a_header_is_refused_before_anything_is_sent() -> None:
    async def main() -> None:
        transport = LeanTransport()
        with pytest.raises(ValueError, match="line break"):
            await transport.send(UpstreamRequest("GET", "http://127.0.0.1:9/x",
                                                 headers={"x-evil": "a\r\nhost: elsewhere"}))

    asyncio.run(main())


def test_https_upstream(tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    try:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                        str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True,
                       timeout=60)
    except FileNotFoundError:
        pytest.fail("the openssl command is needed to make a test certificate")
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(cert, key)
    client_context = ssl.create_default_context(cafile=str(cert))

    async def scenario(upstream: _Upstream, transport: LeanTransport, url: str) -> None:
        for _ in range(2):
            assert await _echo(transport, url, b"secret") == b"echo:secret"
        assert upstream.num_connections == 1

    _with_upstream(scenario, server_context, client_context)


def test_an_answer_ending_in_the_read_that_paused_the_socket_leaves_a_connection_that_still_reads(
        ) -> None:
    body = b"x" * (READ_HIGH_WATER_BYTES + 100)  # the read that crosses the high-water mark ends it

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _ in _each_request(reader):
            writer.write(f"HTTP/1.1 200 OK\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
            await writer.drain()

    async def scenario(transport: LeanTransport, url: str) -> None:
        for _ in range(2):  # the second call runs on the connection the first one paused
            response = await asyncio.wait_for(
                transport.send(UpstreamRequest("GET", f"{url}/x")), 5)
            await asyncio.sleep(0.2)  # the whole answer arrives unread
            assert await asyncio.wait_for(response.read(), 5) == body

    _with_raw_server(handle, scenario)


def test_an_answer_behind_a_released_streams_last_chunk_is_not_the_next_calls_answer() -> None:
    num_connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal num_connections
        num_connections += 1
        is_first = num_connections == 1
        async for _ in _each_request(reader):
            if is_first:  # a stream; its closing chunk and an unasked answer arrive in one read
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n9\r\ndata: "
                             b"1\n\n\r\n")
                await writer.drain()
                await asyncio.sleep(0.1)
                writer.write(b"0\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstray")
                is_first = False
            else:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nfresh")
            await writer.drain()

    async def scenario(transport: LeanTransport, url: str) -> None:
        await _leave_a_stream_at(transport, f"{url}/stream", b"data: 1", release=True)
        await asyncio.sleep(0.3)  # reused once the closing chunk lands
        response = await transport.send(UpstreamRequest("GET", f"{url}/x"))
        assert await response.read() == b"fresh"

    _with_raw_server(handle, scenario)


def test_informational_answers_before_the_answer_are_skipped() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _ in _each_request(reader):
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n"
                         b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()

    async def scenario(transport: LeanTransport, url: str) -> None:
        for _ in range(2):
            response = await transport.send(UpstreamRequest("POST", f"{url}/x", b"{}"))
            assert response.status == 201 and "link" not in response.headers
            assert await response.read() == b"ok"

    _with_raw_server(handle, scenario)


def test_release_of_a_paused_stream_still_reuses_its_connection_once_the_stream_ends() -> None:
    num_connections = 0
    line = b"data: " + b"x" * 1000 + b"\n\n"
    num_lines = 2 * READ_HIGH_WATER_BYTES // len(line)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal num_connections
        num_connections += 1
        async for _ in _each_request(reader):
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for _ in range(num_lines):
                writer.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    async def scenario(transport: LeanTransport, url: str) -> None:
        for _ in range(2):
            response = await transport.send(UpstreamRequest("GET", f"{url}/stream"))
            await asyncio.sleep(0.2)  # the socket pauses with the stream's rest unread
            async for _ in response.lines():
                break
            response.release()  # the caller has what it wants; the rest is on its way
            await asyncio.sleep(0.3)

    _with_raw_server(handle, scenario)
    assert num_connections == 1


def test_idle_connections_left_unused_are_closed_once_their_keepalive_ends() -> None:
    num_open = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal num_open
        num_open += 1
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            num_open -= 1
            writer.close()

    async def scenario(transport: LeanTransport, url: str) -> None:
        async def call() -> None:
            response = await transport.send(UpstreamRequest("GET", f"{url}/x"))
            assert await response.read() == b"ok"

        await asyncio.gather(*(call() for _ in range(3)))  # a burst: three idle connections
        for _ in range(6):  # then one call at a time, always on the newest connection
            await asyncio.sleep(0.1)
            await call()
        await asyncio.sleep(0.05)
        assert num_open == 1  # the two the burst left over were closed, not kept for ever

    _with_raw_server(handle, scenario, LeanTransport(keepalive_timeout_s=0.2))


def test_a_stream_released_before_aclose_drops_its_connection_when_it_ends() -> None:
    closed = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()  # until the client closes the connection
        closed.set()
        writer.close()

    async def scenario(transport: LeanTransport, url: str) -> None:
        # its connection would be pooled once the closing chunk lands
        await _leave_a_stream_at(transport, f"{url}/stream", b"data: 1", release=True)
        await transport.aclose()
        await asyncio.wait_for(closed.wait(), 2)  # not pooled in a pool nobody will close

    _with_raw_server(handle, scenario)


def test_an_unasked_protocol_switch_is_a_malformed_answer() -> None:
    handle = _answer_once(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n"
                          b"connection: upgrade\r\n\r\n", close=False)

    async def scenario(transport: LeanTransport, url: str) -> None:
        with pytest.raises(UpstreamUnavailable, match="malformed"):
            await transport.send(UpstreamRequest("GET", f"{url}/x"))

    _with_raw_server(handle, scenario)
