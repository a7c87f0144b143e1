"""Operations: GET /health, GET /metrics, GET /kv/events, GET /kv/snapshot, POST /kv/reset."""

from __future__ import annotations

import hmac

from aiohttp import web

from engine.server.errors import (
    AuthenticationError,
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
    if not raw.isdigit():
        raise InvalidRequestError("since must be a non-negative integer", param="since")
    return json_response(request.app[SERVING_KEY].engine.kv_events_since(int(raw)))


async def kv_snapshot(request: web.Request) -> web.Response:
    return json_response(request.app[SERVING_KEY].engine.kv_snapshot())


async def kv_reset(request: web.Request) -> web.Response:
    ctx = request.app[SERVING_KEY]
    _require_admin(request, ctx.settings.admin_token)
    return json_response({"reset": await ctx.engine.reset_prefix_cache()})


def _require_admin(request: web.Request, admin_token: str | None) -> None:
    """A configured token must be presented as `Authorization: Bearer`; with none configured,
    only loopback clients are admitted."""
    if admin_token is None:
        if request.remote not in LOOPBACK_ADDRESSES:
            raise PermissionDeniedError("Admin endpoints are restricted to localhost.")
        return
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise AuthenticationError("Missing admin bearer token.")
    if not hmac.compare_digest(token.strip().encode(), admin_token.encode()):
        raise PermissionDeniedError("Invalid admin token.")
