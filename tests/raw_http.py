"""HTTP/1.1 over a raw socket, for requests no client library will send (bytes that are not
UTF-8 in a header, half a request line, a header longer than any limit)."""

from __future__ import annotations

import socket
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
