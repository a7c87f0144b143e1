"""Wiring request logs into the served app (gateway/web/services.py calls `attach_request_log`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from gateway.request_logs import open_request_log
from gateway.request_logs.admin_routes import build_request_log_routes
from gateway.settings import GatewaySettings


async def attach_request_log(app: web.Application, settings: GatewaySettings, auth: Any,
                             prefix: str) -> None:
    """Open the request log on auth's store (its Redis client, else <data_dir>), hand it to the
    pipeline, add its admin routes; its writer starts with the app and, on shutdown, writes what
    is queued after the last settlements (its cleanup runs after the pipeline's)."""
    from gateway.telemetry.keys import TELEMETRY
    from gateway.web.keys import PIPELINE

    request_log = await open_request_log(settings.request_logs, redis=auth.redis,
                                         data_dir=settings.data_dir)
    app[PIPELINE].request_log = request_log
    app.add_routes(build_request_log_routes(request_log, auth.authenticator, prefix))
    if TELEMETRY in app:
        app[TELEMETRY].metrics.request_logs.request_log = request_log  # aigw_request_logs_*

    async def lifecycle(_: web.Application) -> AsyncIterator[None]:
        await request_log.start()
        yield
        await request_log.close()
        await request_log.store.close()

    app.cleanup_ctx.insert(0, lifecycle)
