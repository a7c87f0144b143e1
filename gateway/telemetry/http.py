"""GET /metrics: the gateway's Prometheus text (unauthenticated, like every Prometheus target;
bind the gateway to a private address or filter /metrics at the edge)."""

from __future__ import annotations

from aiohttp import web

from gateway.telemetry.keys import TELEMETRY
from gateway.telemetry.metrics import CONTENT_TYPE


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[TELEMETRY].metrics.render(),
                        headers={"Content-Type": CONTENT_TYPE})
