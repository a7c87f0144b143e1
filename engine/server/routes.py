"""The replica's URL table (handlers live in engine/server/handlers/)."""

from __future__ import annotations

from aiohttp import web

from engine.server.handlers import openai as openai_api
from engine.server.handlers import ops


def setup_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", openai_api.chat_completions)
    app.router.add_post("/v1/completions", openai_api.completions)
    app.router.add_get("/v1/models", openai_api.models)
    app.router.add_post("/v1/embeddings", openai_api.embeddings)
    app.router.add_get("/health", ops.health)
    app.router.add_get("/metrics", ops.metrics)
    app.router.add_get("/kv/events", ops.kv_events)
    app.router.add_get("/kv/snapshot", ops.kv_snapshot)
    app.router.add_post("/kv/reset", ops.kv_reset)
