"""The replica's aiohttp app: `create_app` (factory), `serve` (async) and `run_replica` (sync).

    app = create_app(engine, ReplicaServerSettings.from_env())
    run_replica(engine, "127.0.0.1", 8001, settings)        # blocks; used by `aigw replica`

The engine is created and closed by the caller; the app only serves it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Callable

from aiohttp import web
from aiohttp.web_log import AccessLogger

from engine.server.keys import SERVING_KEY
from engine.server.metrics import ReplicaMetrics
from engine.server.middlewares import (
    add_request_id,
    body_timeout_middleware,
    credential_middleware,
    error_middleware,
)
from engine.server.routes import setup_routes
from engine.server.serving import ServingContext
from engine.server.settings import ReplicaServerSettings
from engine.server.tracing import install_tracing
from engine.server.typedefs import ServedEngine
from infra.http_server import GuardedAppRunner

log = logging.getLogger(__name__)


def create_base_app(settings: ReplicaServerSettings) -> web.Application:
    """An app with what every replica app shares (the chat replica's and the embedding
    replica's, engine/server/embeddings.py): the error envelope, the credential check when a
    secret is set, the body timeout, the body size bound and the request id on every response.
    The caller adds its state, routes and lifecycles."""
    middlewares = [error_middleware]
    if settings.secret is not None:
        middlewares.append(credential_middleware(settings.secret))
    middlewares.append(body_timeout_middleware(settings.client_body_timeout_s))
    app = web.Application(client_max_size=settings.client_max_size_bytes, middlewares=middlewares)
    app.on_response_prepare.append(add_request_id)
    return app


def create_app(engine: ServedEngine, settings: ReplicaServerSettings | None = None
               ) -> web.Application:
    settings = settings or ReplicaServerSettings.from_env()
    app = create_base_app(settings)
    ttft_target_ms, tpot_target_ms = getattr(engine, "latency_targets_ms", (None, None))
    metrics = ReplicaMetrics(engine.stats, model=engine.model_config.model_id,
                             replica=engine.replica_id, ttft_target_ms=ttft_target_ms,
                             tpot_target_ms=tpot_target_ms)
    metrics.set_compute_info(getattr(engine, "compute_info", None))
    engine = install_tracing(app, engine)  # continue the gateway's trace; GET /debug/traces
    app[SERVING_KEY] = ServingContext(engine=engine, settings=settings, metrics=metrics)
    app.cleanup_ctx.append(_log_lifecycle)
    setup_routes(app)
    return app


_POLLED_PATHS = frozenset({"/health", "/metrics", "/kv/events", "/kv/snapshot"})


class QuietAccessLogger(AccessLogger):
    """aiohttp's access log without the gateway's polling (health, load, KV events every few
    seconds per replica), which would drown the requests worth reading."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        if request.path not in _POLLED_PATHS or response.status >= 400:
            super().log(request, response, time)


async def _log_lifecycle(app: web.Application) -> AsyncIterator[None]:
    ctx = app[SERVING_KEY]
    log.info("replica %s serving %s (%s)", ctx.engine.replica_id, ctx.engine.model_config.model_id,
             ", ".join(f"{k}={v}"
                       for k, v in (getattr(ctx.engine, "compute_info", None) or {}).items()
                       if k != "cpu_features"))
    yield
    log.info("replica %s HTTP server stopped", ctx.engine.replica_id)


def create_runner(engine: ServedEngine, settings: ReplicaServerSettings,
                  shutdown_timeout_s: float = 60.0) -> GuardedAppRunner:
    """The app's runner: request headers within `client_header_timeout_s` (infra/http_server.py),
    idle keep-alive connections closed after `keepalive_timeout_s`."""
    return runner_for(create_app(engine, settings), settings, shutdown_timeout_s)


def runner_for(app: web.Application, settings: ReplicaServerSettings,
               shutdown_timeout_s: float = 60.0) -> GuardedAppRunner:
    """A replica app's runner (create_runner's, for any replica app)."""
    return GuardedAppRunner(app, header_timeout_s=settings.client_header_timeout_s,
                            access_log_class=QuietAccessLogger,
                            handler_cancellation=settings.handler_cancellation,
                            keepalive_timeout=settings.keepalive_timeout_s,
                            shutdown_timeout=shutdown_timeout_s)


async def serve(engine: ServedEngine, host: str, port: int,
                settings: ReplicaServerSettings | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Serve until cancelled (or `stop` is set); then stop accepting, let in-flight requests
    finish for up to 60 s, and close connections."""
    resolved = settings or ReplicaServerSettings.from_env()
    await serve_app(lambda: create_app(engine, resolved), host, port, resolved, stop)


async def serve_app(make_app: Callable[[], web.Application], host: str, port: int,
                    settings: ReplicaServerSettings, stop: asyncio.Event | None = None) -> None:
    """`serve` for any replica app, made by `make_app` on the running loop."""
    runner = runner_for(make_app(), settings)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        log.info("listening on http://%s:%d", host, port)
        await (stop or asyncio.Event()).wait()
    finally:
        await runner.cleanup()


def run_replica(engine: ServedEngine, host: str, port: int,
                settings: ReplicaServerSettings | None = None) -> None:
    """Blocking entry point for the CLI: serve until SIGINT/SIGTERM, then shut down gracefully
    (stop accepting, let in-flight requests finish for up to 60 s)."""
    resolved = settings or ReplicaServerSettings.from_env()
    run_until_signal(lambda: create_app(engine, resolved), host, port, resolved)


def run_until_signal(make_app: Callable[[], web.Application], host: str, port: int,
                     settings: ReplicaServerSettings) -> None:
    """`run_replica` for any replica app, made by `make_app` on the loop it runs on."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await serve_app(make_app, host, port, settings, stop)

    asyncio.run(main())
