"""One middleware: every answer carries x-request-id / x-aigw-replica (and the gateway's own time,
for the overhead metric: `pipeline.OVERHEAD_MS`; its header only for admin callers), and
anything that escaped a handler (unknown route, wrong method, a bug) still answers in the route's
error envelope, with no traceback. Redis down or not answering, where a key must be read, is a
503 `store_unavailable` (a key still cached in process keeps working meanwhile)."""

from __future__ import annotations

import logging
import time

from aiohttp import web
from aiohttp.typedefs import Handler
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.dialects import AnthropicMessages, OpenAIChat
from gateway.request.admission import request_id_of
from gateway.request.answer import OVERHEAD_MS, error_response
from gateway.web.routes import is_anthropic_path
from infra.http_server import abandoning_unread_body

log = logging.getLogger("aigw.gateway")
_OPENAI = OpenAIChat()
_ANTHROPIC = AnthropicMessages()
_CODES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}


@web.middleware
async def envelope_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    started = time.perf_counter()
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        message = _not_found_message(request) if exc.status == 404 else exc.reason
        response = _error(request, exc.status, _CODES.get(exc.status, "http_error"), message,
                          started)
        return abandoning_unread_body(request, response)
    except (RedisConnectionError, RedisTimeoutError) as exc:  # keys, limits, the admin API
        log.warning("store unavailable on %s %s: %s", request.method, request.path, exc)
        response = _error(request, 503, "store_unavailable",
                          "the gateway's data store (keys, limits) is unreachable; retry shortly",
                          started)
        return abandoning_unread_body(request, response)
    except Exception:  # noqa: BLE001 - never a traceback to the client
        log.exception("unhandled error on %s %s", request.method, request.path)
        response = _error(request, 500, "internal_error", "internal gateway error", started)
        return abandoning_unread_body(request, response)
    abandoning_unread_body(request, response)
    if response.prepared:  # (the pipeline's answers: sent already, nothing to add)
        return response
    if request.content.exception() is not None or response.status == 408:
        # the body could not be read (a Content-Encoding it does not have), or did not come in
        # time: the rest of it is unreadable too, so say this connection closes instead of
        # leaving the client to reuse it
        response.force_close()
    headers = response.headers
    if "x-request-id" not in headers:
        headers["x-request-id"] = request_id_of(request)
        headers.setdefault("x-aigw-replica", "none")
        response[OVERHEAD_MS] = (time.perf_counter() - started) * 1000
    return response


def _not_found_message(request: web.Request) -> str:
    """"Not Found", with the route meant when the path is one an SDK's base_url missed by a
    `/v1` (OpenAI's base_url without it: /chat/completions) or doubled (Anthropic's base_url
    with it: /anthropic/v1/v1/messages). Only a known route is named, never the caller's path."""
    path = request.path
    if "/v1/v1/" in path:
        meant = path.replace("/v1/v1/", "/v1/", 1)
    elif path.startswith("/anthropic/"):
        meant = "/anthropic/v1/" + path[len("/anthropic/"):]
    elif path.startswith("/openai/"):
        meant = "/openai/v1/" + path[len("/openai/"):]
    else:
        meant = "/v1" + path
    if meant not in {resource.canonical for resource in request.app.router.resources()}:
        return "Not Found"
    return (f"Not Found; did you mean {meant}? (the OpenAI SDKs' base_url is the gateway's "
            "URL with /v1, the Anthropic SDKs' the gateway's URL with /anthropic)")


def _error(request: web.Request, status: int, code: str, message: str,
           started: float) -> web.Response:
    dialect = _ANTHROPIC if is_anthropic_path(request.path) else _OPENAI
    return error_response(dialect, status, code, message, request_id_of(request),
                          (time.perf_counter() - started) * 1000)
