"""The one way a request's JSON body is read, on every route of the gateway and the admin API.

    body = await read_json(request, max_body_bytes, timeout_s)   # raises BodyError

Bounded four ways: the time it takes to arrive (`timeout_s`, one timer for the whole body, armed
only when the body is not all received yet: a client that sends its headers and then trickles,
or stops, is answered 408 instead of holding the handler forever), its bytes
(`max_body_bytes`, checked against Content-Length first and then against what was read, for a
chunked body), its nesting (orjson stops at 1,024 levels, where
the standard library's parser recursed until RecursionError: a 500), and its numbers (orjson
refuses a number beyond a double's range, where `json.loads` made a 400-digit int that later
overflowed `float()`). Bytes that are not UTF-8 and a Content-Encoding the body does not have
are 400s; a Content-Encoding that is not one of DECODABLE_ENCODINGS (`foo`, two at once) is a 415
naming those, where aiohttp passed the bytes on as identity. Callers map `BodyError` onto their
own error envelope.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web
from aiohttp.compression_utils import HAS_BROTLI, HAS_ZSTD
from aiohttp.web_protocol import RequestPayloadError

# The Content-Encodings a request body may come in besides identity: those aiohttp decodes here
# (br with Brotli installed, zstd with Python 3.14's compression.zstd or backports.zstd).
DECODABLE_ENCODINGS = ("gzip", "deflate", *(("br",) if HAS_BROTLI else ()),
                       *(("zstd",) if HAS_ZSTD else ()))


class BodyError(ValueError):
    """`status` 413 (too large), 408 (too slow), 415 (an encoding not decoded here) or 400 (not
    JSON, not what its Content-Encoding says)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def read_json(request: web.Request, max_body_bytes: int,
                    timeout_s: float | None = None) -> Any:
    """The request's JSON body, read within `timeout_s` (None: no bound); raises BodyError
    (408 for a body that did not arrive in time)."""
    refusal = undecodable_encoding(request.headers.get("Content-Encoding"))
    if refusal is not None:
        raise BodyError(415, refusal)
    content_length = request.content_length
    if content_length is not None and content_length > max_body_bytes:
        raise BodyError(413, f"body over {max_body_bytes} bytes")
    # a known length is one read (aiohttp caps it too); a chunked body is counted as it comes
    reading = (request.read() if content_length is not None
               else _read_chunked(request, max_body_bytes))
    try:
        if timeout_s is None or request.content.is_eof():
            # (all of it is here, as a small body that came with its headers is: nothing to wait
            # for, so no timer to arm and cancel)
            raw = await reading
        else:
            async with asyncio.timeout(timeout_s):
                raw = await reading
    except TimeoutError as exc:
        raise BodyError(408, f"the request body did not arrive within {timeout_s:g}s") from exc
    except web.HTTPRequestEntityTooLarge as exc:  # over the app's own client_max_size
        raise BodyError(413, f"body over {max_body_bytes} bytes") from exc
    except RequestPayloadError as exc:  # e.g. a Content-Encoding: gzip body that is not gzip
        raise BodyError(400, f"body cannot be decoded as its Content-Encoding "
                             f"{request.headers.get('Content-Encoding', '')!r} says") from exc
    try:  # orjson: the nesting and number bounds above
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BodyError(400, f"body is not valid JSON: {_not_utf8(raw) or exc}") from exc


def _not_utf8(raw: bytes) -> str | None:
    """What is wrong with a body that is not UTF-8 (a shell's Latin-1 text), else None: orjson
    says 'str is not valid UTF-8: surrogates not allowed' at char 0, whatever the byte."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return (f"byte {exc.start} (0x{raw[exc.start]:02x}) is not UTF-8: a JSON body is UTF-8 "
                f"text (send it encoded as UTF-8, or escape the character as \\uXXXX)")
    return None


def undecodable_encoding(content_encoding: str | None) -> str | None:
    """None when a body with this Content-Encoding header can be read (no header, identity, one
    of DECODABLE_ENCODINGS); else the 415's message, naming the encodings that can."""
    if content_encoding is None or content_encoding.strip().lower() in (
            "", "identity", *DECODABLE_ENCODINGS):
        return None
    return (f"Content-Encoding {content_encoding[:40]!r} is not supported: send the body as "
            f"{', '.join(DECODABLE_ENCODINGS)} or identity (one encoding, no list)")


async def _read_chunked(request: web.Request, max_body_bytes: int) -> bytes:
    """A body of unknown length (chunked), counted against `max_body_bytes` as it comes."""
    chunks: list[bytes] = []
    num_bytes = 0
    while chunk := await request.content.read(_CHUNK_BYTES):
        num_bytes += len(chunk)
        if num_bytes > max_body_bytes:
            raise BodyError(413, f"body over {max_body_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


_CHUNK_BYTES = 64 * 1024

