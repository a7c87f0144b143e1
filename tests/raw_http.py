"""HTTP/1.1 over a raw socket, for requests no client library will send (bytes that are not
UTF-8 in a header, half a request line, a header longer than any limit)."""

from __future__ import annotations

import contextlib
import socket
import zlib
from urllib.parse import urlsplit

import orjson


def send_raw(url: str, request: bytes, timeout_s: float = 5.0) -> tuple[int, bytes, bytes]:
    """(status, header bytes, body bytes) of the answer to `request` (sent as is; it should say
    `Connection: close`)."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s) as sock:
        sock.sendall(request)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), head, body


def request_bytes(method: str, path: str, headers: dict[str, bytes], body: object = None) -> bytes:
    """One request with these headers (values as raw bytes), a JSON body, `Connection: close`."""
    payload = b"" if body is None else orjson.dumps(body)
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: test"]
    lines += [name.encode() + b": " + value for name, value in headers.items()]
    if body is not None:
        lines += [b"Content-Type: application/json", b"Content-Length: %d" % len(payload)]
    lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n" + payload


def gzip_of_zeros(num_mib: int) -> bytes:
    """A gzip stream (never ended) inflating to `num_mib` MiB of zeros, ~1 KB a MiB: one
    flushed deflate block repeated (each block starts afresh)."""
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = deflate.compress(bytes(1 << 20)) + deflate.flush(zlib.Z_FULL_FLUSH)
    return b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + block * num_mib


def post_gzip_of_zeros(url: str, path: str, num_mib: int, timeout_s: float = 2.0) -> bytes:
    """POST `gzip_of_zeros(num_mib)` to `path` as JSON and read what comes back until the server
    closes (or `timeout_s` of silence): the answer's bytes. Sending stops where the server stops
    reading."""
    parts = urlsplit(url)
    body = gzip_of_zeros(num_mib)
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     f"Content-Encoding: gzip\r\nContent-Length: {len(body)}\r\n\r\n".encode())
        with contextlib.suppress(TimeoutError, ConnectionError):
            sock.sendall(body)
        answer = b""
        with contextlib.suppress(TimeoutError, ConnectionError):
            while chunk := sock.recv(65536):
                answer += chunk
    return answer
