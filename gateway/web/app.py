"""The app factory: `create_app(settings, authenticator=..., meter=...)`.

Lifecycles (cleanup_ctx, in order): the upstream transport (LeanTransport: keep-alive connections
pooled per upstream), the first discovery round (models with `discover`:
gateway/fleet/discovery.py), the router's own tasks (`Router.start/close`), the discovery task
(every `health_interval_s`; it tells the router of changes), the health checker task, then (on
shutdown only) the wait for the settlements still counting a prompt (`Pipeline.wait_settled`). The
router's close is bounded (`ROUTER_CLOSE_TIMEOUT_S`): a Redis index that stopped answering must not
hold a drain forever. With `settings.auth_enabled` false and nothing injected, auth's
AnonymousAuthenticator and gateway/metering/null_meter.py's NullMeter are used; with auth on, both
must be injected (gateway/web/services.py::create_served_app does that with the real auth/ and
metering/).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable

from aiohttp import web

from auth.authenticator import AnonymousAuthenticator
from auth.principal import Authenticator
from gateway.batch.service import BatchService, run_batch_service
from gateway.dashboard.slo import SloRates
from gateway.fleet.discovery import Discovery, Resolver, resolve_dns
from gateway.fleet.endpoints import Fleet
from gateway.fleet.health import check_fleet, run_health_checks
from gateway.metering.contract import Meter
from gateway.metering.null_meter import NullMeter
from gateway.request.pipeline import CacheSaltOf, Pipeline, default_cache_salt_of
from gateway.responses_store import StoredResponses, open_response_store
from gateway.routing import Router, create_router
from gateway.settings import GatewaySettings
from gateway.telemetry import Telemetry
from gateway.upstream.lean_transport import LeanTransport
from gateway.upstream.transport import Transport
from gateway.web.keys import (
    AUTHENTICATOR,
    BATCH,
    DISCOVERY,
    FLEET,
    METER,
    PIPELINE,
    RESPONSES,
    ROUTER,
    SETTINGS,
    SLO_RATES,
    TRANSPORT,
)
from gateway.web.middlewares import envelope_middleware
from gateway.web.routes import setup_routes

log = logging.getLogger(__name__)

ROUTER_CLOSE_TIMEOUT_S = 10.0


def create_app(settings: GatewaySettings, *, authenticator: Authenticator | None = None,
               meter: Meter | None = None, router: Router | None = None,
               transport: Transport | None = None, telemetry: Telemetry | None = None,
               cache_salt_of: CacheSaltOf = default_cache_salt_of,
               resolve: Resolver = resolve_dns) -> web.Application:
    # the body cap is enforced by the pipeline (413 in the dialect's envelope); aiohttp's own cap
    # sits just above it so a chunked body over the cap is still cut off.
    telemetry = telemetry or Telemetry()  # traces, /metrics, the dashboard's series
    app = web.Application(client_max_size=settings.max_body_bytes + 1,
                          middlewares=[telemetry.middleware, envelope_middleware])
    app[SETTINGS] = settings
    app[TRANSPORT] = transport or LeanTransport()
    app[ROUTER] = router or create_router(settings.router, settings)
    app[FLEET] = Fleet(settings, app[TRANSPORT])
    app[DISCOVERY] = Discovery(app[FLEET], app[ROUTER], resolve)
    if not settings.auth_enabled:
        app[AUTHENTICATOR] = authenticator or AnonymousAuthenticator()
        app[METER] = meter or NullMeter()
    elif authenticator is not None and meter is not None:
        app[AUTHENTICATOR], app[METER] = authenticator, meter
    else:
        raise ValueError("auth is enabled: inject an authenticator and a meter, or build the app "
                         "with gateway.web.services.create_served_app(settings)")
    telemetry.attach(settings, app[FLEET])
    app[PIPELINE] = Pipeline(settings, app[AUTHENTICATOR], app[METER], app[ROUTER], app[FLEET],
                             cache_salt_of)
    # (each request's observer comes from the telemetry middleware; batch lines use this one)
    app[PIPELINE].background_observer = telemetry.background_observer()
    app[RESPONSES] = StoredResponses(open_response_store(settings))  # (opens on first use)
    app[BATCH] = BatchService(settings)
    app[SLO_RATES] = SloRates()  # the dashboard's per-class goodput and refusals per second
    telemetry.metrics.batch.counts = app[BATCH].counts  # aigw_batch_* on /metrics
    telemetry.metrics.guardrails.guardrails = app[PIPELINE].guardrails  # aigw_guardrail_*
    telemetry.install(app)
    app.cleanup_ctx.append(_transport_ctx)
    app.cleanup_ctx.append(_responses_ctx)
    app.cleanup_ctx.append(_first_discovery_ctx)
    app.cleanup_ctx.append(_router_ctx)
    app.cleanup_ctx.append(_discovery_ctx)
    app.cleanup_ctx.append(_health_ctx)
    app.cleanup_ctx.append(_settlements_ctx)
    app.cleanup_ctx.append(_batch_ctx)  # (closed first: its lines settle before the meter closes)
    app.on_shutdown.append(_start_draining)
    setup_routes(app)
    return app


async def _transport_ctx(app: web.Application) -> AsyncIterator[None]:
    yield
    await app[TRANSPORT].aclose()


async def _responses_ctx(app: web.Application) -> AsyncIterator[None]:
    yield
    await app[RESPONSES].close()


async def _router_ctx(app: web.Application) -> AsyncIterator[None]:
    await app[ROUTER].start(app[FLEET])
    yield
    await _bounded(app[ROUTER].close(), ROUTER_CLOSE_TIMEOUT_S, "the router's close")


async def _bounded(step: Awaitable[None], timeout_s: float, what: str) -> None:
    """Await `step` for at most `timeout_s`, then cancel it and go on (without waiting for the
    cancellation to land: a step stuck on a dead peer may not honour it promptly)."""
    task = asyncio.ensure_future(step)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()
        # whatever it ends with later is not logged as unretrieved
        task.add_done_callback(_retrieve)
        log.warning("%s did not finish within %gs; shutdown goes on without it", what, timeout_s)
    elif task.exception() is not None:
        log.warning("%s failed: %r", what, task.exception())


def _retrieve(task: asyncio.Future[None]) -> None:
    if not task.cancelled():
        task.exception()


async def _first_discovery_ctx(app: web.Application) -> AsyncIterator[None]:
    """Endpoints before serving (bounded; the router's `start` then sees them)."""
    if app[DISCOVERY].is_active:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(app[DISCOVERY].refresh(notify_router=False),
                                   app[SETTINGS].health_timeout_s * 2)
    yield


async def _discovery_ctx(app: web.Application) -> AsyncIterator[None]:
    if not app[DISCOVERY].is_active:
        yield
        return
    settings = app[SETTINGS]
    task = asyncio.create_task(app[DISCOVERY].run(settings.health_interval_s,
                                                  settings.health_timeout_s * 2))
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _health_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    with contextlib.suppress(TimeoutError):  # first round before serving, bounded
        await asyncio.wait_for(check_fleet(app[FLEET]), settings.health_timeout_s * 2)
    task = asyncio.create_task(run_health_checks(app[FLEET], settings.health_interval_s))
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _settlements_ctx(app: web.Application) -> AsyncIterator[None]:
    yield
    await app[PIPELINE].wait_settled()  # before the meter closes (gateway/web/services.py)


async def _batch_ctx(app: web.Application) -> AsyncIterator[None]:
    """The Batch API's store and runner (gateway/batch/service.py)."""
    async for _ in run_batch_service(app[BATCH], app[PIPELINE], app[FLEET]):
        yield


async def _start_draining(app: web.Application) -> None:
    app[PIPELINE].draining = True
