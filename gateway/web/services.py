"""Wiring the real auth/ (API keys, JWT) and gateway/metering/ (usage, limits) into the gateway.

    app = await create_served_app(settings)     # opens both, then create_app(..., injected)

They are opened before the app is built (not inside a cleanup_ctx startup) because the admin API's
routes close over the opened auth services and must be added before the router freezes; a
cleanup_ctx entry closes them on shutdown. Both share one Redis client when `redis_url` is set,
else one SQLite file under `data_dir`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from aiohttp import web

from gateway.settings import GatewaySettings
from gateway.web.app import create_app

log = logging.getLogger("aigw.gateway")
ADMIN_PREFIX = "/admin/v1"


def metering_settings(settings: GatewaySettings) -> Any:
    """Our per-token prices and all limits (project and key, defaults and overrides, daily
    budgets), in metering's units (USD per million tokens)."""
    from gateway.metering import Limits, MeteringSettings, ModelPrice

    def limits_of(given: Any) -> Any:
        return Limits(**given.model_dump())

    prices = {m.name: ModelPrice(input=m.prices.input_per_token * 1e6,
                                 output=m.prices.output_per_token * 1e6,
                                 cached_input=m.prices.cached_input_per_token * 1e6)
              for m in settings.models}
    return MeteringSettings(
        enabled=settings.auth_enabled, prices=prices,
        default_project_limits=limits_of(settings.limits),
        default_key_limits=limits_of(settings.key_limits),
        project_limits={name: limits_of(v) for name, v in settings.project_limits.items()},
        key_limits={key_id: limits_of(v) for key_id, v in settings.key_limits_by_id.items()},
        backlog_max_bytes=settings.metering_backlog_max_bytes)


async def open_limits(meter: Any, redis: Any | None, settings: GatewaySettings,
                      poll_interval_s: float) -> Any:
    """The run-time limits (admin API, `aigw limits`): their store on the same Redis or SQLite
    file, and the watcher that keeps `meter` applying them (started: loaded before serving)."""
    from gateway.metering.limit_store import open_limit_store
    from gateway.metering.limit_watcher import LimitWatcher
    from gateway.web.limit_routes import LimitServices

    store = await open_limit_store(redis, settings.data_dir)
    watcher = LimitWatcher(store, meter.set_stored_limits, poll_interval_s)
    try:
        await watcher.start()
    except BaseException:
        await store.close()
        raise
    return LimitServices(store, watcher, meter)


async def create_served_app(settings: GatewaySettings) -> web.Application:
    """The gateway as `aigw serve` runs it: real auth and metering unless auth is disabled."""
    if not settings.auth_enabled:
        return create_app(settings)
    from auth import AuthSettings, cache_salt_for, ensure_default_project, open_auth
    from gateway.metering import open_meter
    from gateway.request_logs.served import attach_request_log
    from gateway.web.admin_routes import build_admin_routes
    from gateway.web.limit_routes import build_limit_routes

    auth_settings = AuthSettings.from_env().model_copy(update={
        "enabled": True, "redis_url": settings.redis_url, "data_dir": settings.data_dir,
        "cache_salt_scope": settings.cache_salt_scope})
    auth = await open_auth(auth_settings)
    try:
        meter = await open_meter(metering_settings(settings), redis=auth.redis,
                                 data_dir=settings.data_dir)
        secret = await ensure_default_project(auth)
        if secret:
            print(f"aigw: created project 'default' with API key {secret} "
                  f"(also in {auth_settings.default_key_path})", flush=True)
        limits = await open_limits(meter, auth.redis, settings,
                                   auth_settings.revocation_poll_interval_s)
    except BaseException:
        await auth.close()
        raise
    app = create_app(settings, authenticator=auth.authenticator, meter=meter,
                     cache_salt_of=partial(cache_salt_for, settings=auth_settings))
    app.add_routes(build_admin_routes(auth, ADMIN_PREFIX))
    app.add_routes(build_limit_routes(auth, limits, ADMIN_PREFIX))
    await attach_request_log(app, settings, auth, ADMIN_PREFIX)  # (gateway/request_logs/)

    async def close_services(_: web.Application) -> AsyncIterator[None]:
        yield
        await limits.watcher.stop()
        await limits.store.close()
        await meter.close()
        await auth.close()

    app.cleanup_ctx.insert(0, close_services)
    return app
