"""The replica's HTTP API: OpenAI-compatible chat/completions, /metrics and KV-cache endpoints.

    create_app(engine, settings) -> aiohttp.web.Application
    serve(engine, host, port, settings)         (async, runs until cancelled)
    run_replica(engine, host, port, settings)   (blocking, for the CLI)
"""

from engine.server.app import create_app, run_replica, serve
from engine.server.settings import ReplicaServerSettings

__all__ = ["create_app", "serve", "run_replica", "ReplicaServerSettings"]
