"""Request ids and the error envelope, for every route (including unknown ones).

- `x-request-id`: the client's value is echoed when it is 1-128 of [A-Za-z0-9._:-], otherwise
  one is generated; it is set on every response, streamed or not, through on_response_prepare.
- `error_middleware`: APIError -> its envelope; aiohttp HTTP errors (404, 405, 413, ...) -> the
  envelope with their status; anything else -> a logged 500 envelope, never a traceback.
"""

from __future__ import annotations

import logging
import re
import uuid

from aiohttp import web
from aiohttp.typedefs import Handler

from engine.server.errors import APIError, json_error
from engine.server.keys import REQUEST_ID_KEY

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
    request_id_of(request)
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
