"""The URL table, and nothing else."""

from __future__ import annotations

from aiohttp import web

from gateway import handlers


def setup_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_post("/v1/responses", handlers.responses)
    app.router.add_post("/openai/v1/responses", handlers.responses)
    app.router.add_post("/openai/v1/chat/completions", handlers.chat_completions)
    app.router.add_post("/anthropic/v1/messages", handlers.messages)
    app.router.add_post("/v1/messages", handlers.messages)
    app.router.add_get("/v1/models", handlers.list_models)
    app.router.add_get("/openai/v1/models", handlers.list_models)
    app.router.add_get("/health", handlers.health)


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/anthropic/") or path == "/v1/messages"
