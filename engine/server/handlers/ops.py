"""Operations: GET /health, GET /metrics, GET /kv/events, GET /kv/snapshot, POST /kv/reset.

With a replica secret, all but /health and /metrics sit behind the credential middleware
(engine/server/middlewares.py); without one (`--no-auth`), POST /kv/reset is loopback-only.
"""

from __future__ import annotations

from aiohttp import web

from contracts.replica_errors import (
    InvalidRequestError,
    PermissionDeniedError,
    ServiceUnavailableError,
    json_response,
)
from engine.server.keys import SERVING_KEY
from engine.server.metrics import CONTENT_TYPE

LOOPBACK_ADDRESSES = frozenset({"127.0.0.1", "::1"})


async def health(request: web.Request) -> web.Response:
    engine = request.app[SERVING_KEY].engine
    if not getattr(engine, "is_alive", True):  # engines without the flag count as alive
        raise ServiceUnavailableError("The engine loop is not running.")
    return json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[SERVING_KEY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def kv_events(request: web.Request) -> web.Response:
    raw = request.query.get("since", "0")
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 18):  # (isdigit alone takes '²')
        raise InvalidRequestError("since must be a non-negative integer", param="since")
    return json_response(request.app[SERVING_KEY].engine.kv_events_since(int(raw)))


async def kv_snapshot(request: web.Request) -> web.Response:
    return json_response(request.app[SERVING_KEY].engine.kv_snapshot())


async def kv_reset(request: web.Request) -> web.Response:
    ctx = request.app[SERVING_KEY]
    if ctx.settings.secret is None and request.remote not in LOOPBACK_ADDRESSES:
        raise PermissionDeniedError("Without a replica secret, POST /kv/reset is restricted to "
                                    "localhost.")
    return json_response({"reset": await ctx.engine.reset_prefix_cache()})
