"""Request ids and the error envelope, for every route (including unknown ones).

- `x-request-id`: the client's value is echoed when it is 1-128 of [A-Za-z0-9._:-], otherwise
  one is generated; it is set on every response, streamed or not, through on_response_prepare.
- `error_middleware`: APIError -> its envelope; aiohttp HTTP errors (404, 405, 413, ...) -> the
  envelope with their status; anything else -> a logged 500 envelope, never a traceback.
- `credential_middleware(secret)`: every route but `OPEN_PATHS` (unknown ones too) needs
  `Authorization: Bearer <secret>`, compared in constant time; else 401 in the envelope.
- `body_timeout_middleware(timeout_s)`: a request's body is read whole within `timeout_s` before
  its handler runs (aiohttp keeps it for the handler's own read); else 408 in the envelope and
  the connection closes. A Content-Encoding it does not decode is a 415 naming those it does.
  Request headers are bounded by the runner (infra/http_server.py).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Handler

from contracts.replica_errors import APIError, AuthenticationError, json_error
from engine.server.keys import REQUEST_ID_KEY
from infra.http_server import abandoning_unread_body
from infra.json_body import undecodable_encoding

log = logging.getLogger(__name__)
REQUEST_ID_HEADER = "x-request-id"
_SAFE_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")  # the gateway echoes the same set


def request_id_of(request: web.Request) -> str:
    request_id = request.get(REQUEST_ID_KEY)
    if request_id is None:
        given = request.headers.get(REQUEST_ID_HEADER, "")
        request_id = given if _SAFE_REQUEST_ID.match(given) else uuid.uuid4().hex
        request[REQUEST_ID_KEY] = request_id
    return request_id


async def add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    response.headers[REQUEST_ID_HEADER] = request_id_of(request)


def _http_error(exc: web.HTTPException, request: web.Request) -> web.Response:
    status = exc.status
    if status == 404:
        return json_error(404, f"Invalid URL ({request.method} {request.path})",
                          "invalid_request_error", code="not_found")
    if status == 405:
        return json_error(405, f"Method {request.method} is not allowed for {request.path}",
                          "invalid_request_error", code="method_not_allowed")
    if status == 413:
        return json_error(413, "The request body is too large.", "invalid_request_error",
                          code="request_too_large")
    error_type = "invalid_request_error" if status < 500 else "server_error"
    return json_error(status, exc.reason, error_type)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Also: an answer that leaves a compressed body unread (a 401, a 413) closes the connection
    without the rest being read or inflated (infra/http_server.abandoning_unread_body)."""
    request_id_of(request)
    return abandoning_unread_body(request, await _answer(request, handler))


async def _answer(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as exc:
        return exc.to_response()
    except web.HTTPException as exc:
        if exc.status < 400:  # redirects and the like pass through
            raise
        return _http_error(exc, request)
    except Exception:
        log.exception("unhandled error in %s %s (x-request-id %s)", request.method, request.path,
                      request_id_of(request))
        return json_error(500, "The server had an error while processing your request.",
                          "server_error")


# Open to anyone who can reach the port: liveness ({"status": "ok"} or 503) and the aggregate
# engine gauges and counters (labels model and replica only; no project, key, prompt or token).
OPEN_PATHS = frozenset({"/health", "/metrics"})


def credential_middleware(secret: str) -> Callable[..., Awaitable[web.StreamResponse]]:
    """The gateway's credential check (goes inside `error_middleware`, which renders the 401)."""
    expected = secret.encode("utf-8")

    @web.middleware
    async def require_credential(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS and not _presents(request, expected):
            raise AuthenticationError("A valid replica credential is required "
                                      "(Authorization: Bearer <AIGW_REPLICA_SECRET>).")
        return await handler(request)

    return require_credential


def _presents(request: web.Request, expected: bytes) -> bool:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    # a header byte that is not UTF-8 arrives as a lone surrogate: never equal, never a 500
    given = token.strip().encode("utf-8", "surrogatepass")
    return hmac.compare_digest(given, expected)


def body_timeout_middleware(timeout_s: float) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Goes inside `credential_middleware`: nobody's body is waited for before they are known."""

    @web.middleware
    async def read_body_in_time(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.body_exists:
            refusal = undecodable_encoding(request.headers.get("Content-Encoding"))
            if refusal is not None:  # (aiohttp passes an encoding it does not know as identity)
                return json_error(415, refusal, "invalid_request_error",
                                  code="unsupported_media_type")
            try:
                async with asyncio.timeout(timeout_s):
                    await request.read()  # HTTPRequestEntityTooLarge -> 413 (error_middleware)
            except TimeoutError:
                log.warning("closing a connection from %s: its request body did not arrive "
                            "within %gs (%s %s)", request.remote, timeout_s, request.method,
                            request.path)
                response = json_error(408, f"The request body did not arrive within "
                                           f"{timeout_s:g}s.", "invalid_request_error",
                                      code="request_timeout")
                response.force_close()
                return response
        return await handler(request)

    return read_body_in_time
