"""Running the gateway: one process serves until SIGTERM/SIGINT, then drains.

Drain: /health turns 503 and new requests get 503 `draining`, the listening socket closes, and
in-flight requests get up to `settings.drain_timeout_s` to finish (streams still running then are
ended with their dialect's error event; aiohttp's shutdown_timeout is `STREAM_END_MARGIN_S`
longer) before the cleanup contexts close the upstream sessions and the auth/metering stores.
With `--workers N`, N such processes share the port through SO_REUSEPORT. Every connection must
send a request's headers within `client_header_timeout_s` (infra/http_server.py).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from typing import Any

from aiohttp import web

from gateway.dialects import AnthropicMessages, OpenAIChat
from gateway.request.admission import new_request_id
from gateway.request.answer import error_response
from gateway.settings import GatewaySettings
from gateway.web.keys import PIPELINE
from gateway.web.routes import is_anthropic_path
from gateway.web.services import create_served_app
from infra.http_server import GuardedAppRunner

log = logging.getLogger("aigw.gateway")
_OPENAI, _ANTHROPIC = OpenAIChat(), AnthropicMessages()
# aiohttp's own drain wait (shutdown_timeout) ends this long after `drain_timeout_s`, when the
# streams still running have been ended (drain): a handler that finished in the same moment as
# aiohttp's wait timed out made aiohttp log "Unhandled exception ... InvalidStateError" (its
# waiter was cancelled but not yet cleared); ending a stream (its error event, the upstream's
# close, the settle) takes milliseconds, so the margin costs nothing unless a non-streamed
# request is still running then
STREAM_END_MARGIN_S = 1.0


async def serve(settings: GatewaySettings, *, reuse_port: bool = False) -> None:
    app = await create_served_app(settings)
    runner = gateway_runner(app, settings)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port, reuse_port=reuse_port, backlog=2048)
    await site.start()
    # Everything built so far (modules, settings, the app) lives as long as the process: moved
    # out of the collector's reach, full collections stop re-scanning it on every request burst.
    # Young collections: every 7000 net allocations instead of 700 (a request frees almost all it
    # allocates by reference counting; what a collection then finds is mostly in-flight state).
    gc.collect()
    gc.freeze()
    gc.set_threshold(7000, 20, 20)
    names = [model.name for model in settings.models]  # what clients send as `model`
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    log.warning("aigw serving on http://%s:%s, models: %s", settings.host, settings.port,
                shown or "none")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        await drain(runner)


def gateway_runner(app: web.Application, settings: GatewaySettings) -> GuardedAppRunner:
    """The runner of the gateway's listener: header deadline, keep-alive, drain timeout, and
    requests aiohttp's parser refuses answered in the route's envelope."""
    return GuardedAppRunner(app, header_timeout_s=settings.client_header_timeout_s,
                            error_answer=parser_error_answer,
                            keepalive_timeout=settings.keepalive_timeout_s,
                            handler_cancellation=True, access_log=None,
                            shutdown_timeout=settings.drain_timeout_s + STREAM_END_MARGIN_S)


def parser_error_answer(path: str, status: int, code: str, message: str) -> web.Response:
    """A request refused before any handler ran, in the envelope its path's routes answer in."""
    dialect = _ANTHROPIC if is_anthropic_path(path) else _OPENAI
    return error_response(dialect, status, code, message, new_request_id(), 0.0)


async def drain(runner: web.AppRunner) -> None:
    """Refuse new requests (503 `draining`), stop listening, let in-flight ones finish within the
    runner's shutdown_timeout (`drain_timeout_s`), then run the cleanup contexts. A stream still
    running at `drain_timeout_s` ends with its dialect's error event (Answerer.end_streams);
    aiohttp alone would keep it a second shutdown_timeout, then cut it mid-chunk."""
    pipeline = runner.app[PIPELINE]
    pipeline.draining = True
    deadline = asyncio.get_running_loop().call_later(pipeline.settings.drain_timeout_s,
                                                     pipeline.answerer.end_streams)
    try:
        await runner.cleanup()
    finally:
        deadline.cancel()


def run_worker(settings_data: dict[str, Any], reuse_port: bool) -> None:
    """Entry point of one worker process (spawned): serve these settings."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(GatewaySettings(**settings_data), reuse_port=reuse_port))
