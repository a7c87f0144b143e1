"""The URL table, and nothing else."""

from __future__ import annotations

from aiohttp import web

from gateway.batch import handlers as batch
from gateway.dashboard import STATIC_DIR
from gateway.dashboard import handlers as dashboard
from gateway.dashboard import sessions as dashboard_sessions
from gateway.telemetry import http as telemetry
from gateway.web import handlers, stored_responses
from gateway.web.keys import RESPONSES


def setup_routes(app: web.Application) -> None:
    """After app[PIPELINE] and app[RESPONSES] exist (the model routes' handlers are bound to
    them)."""
    model_handler = handlers.model_handler
    chat_completions = model_handler(app, handlers.OPENAI_CHAT)
    completions = model_handler(app, handlers.OPENAI_COMPLETIONS)
    responses = model_handler(app, handlers.OPENAI_RESPONSES, app[RESPONSES])
    embeddings = model_handler(app, handlers.OPENAI_EMBEDDINGS)
    messages = model_handler(app, handlers.ANTHROPIC_MESSAGES)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/openai/v1/completions", completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/openai/v1/responses", responses)
    for prefix in ("/v1", "/openai/v1"):
        app.router.add_get(prefix + "/responses/{response_id}", stored_responses.retrieve)
        app.router.add_delete(prefix + "/responses/{response_id}", stored_responses.delete)
        app.router.add_get(prefix + "/responses/{response_id}/input_items",
                           stored_responses.input_items)
    app.router.add_post("/openai/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/openai/v1/embeddings", embeddings)
    app.router.add_post("/anthropic/v1/messages", messages)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/anthropic/v1/messages/count_tokens", handlers.count_tokens)
    app.router.add_post("/v1/messages/count_tokens", handlers.count_tokens)
    app.router.add_get("/v1/models", handlers.list_models)
    app.router.add_get("/openai/v1/models", handlers.list_models)
    app.router.add_get("/v1/models/{model:.+}", handlers.retrieve_model)
    app.router.add_get("/openai/v1/models/{model:.+}", handlers.retrieve_model)
    app.router.add_get("/anthropic/v1/models", handlers.anthropic_models)
    app.router.add_get("/anthropic/v1/models/{model:.+}", handlers.anthropic_models)
    for prefix in ("/v1", "/openai/v1"):  # the Batch API (gateway/batch/)
        app.router.add_post(f"{prefix}/files", batch.upload_file)
        app.router.add_get(f"{prefix}/files", batch.list_files)
        app.router.add_get(f"{prefix}/files/{{file_id}}", batch.retrieve_file)
        app.router.add_delete(f"{prefix}/files/{{file_id}}", batch.delete_file)
        app.router.add_get(f"{prefix}/files/{{file_id}}/content", batch.file_content)
        app.router.add_post(f"{prefix}/batches", batch.create_batch)
        app.router.add_get(f"{prefix}/batches", batch.list_batches)
        app.router.add_get(f"{prefix}/batches/{{batch_id}}", batch.retrieve_batch)
        app.router.add_post(f"{prefix}/batches/{{batch_id}}/cancel", batch.cancel_batch)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/health/live", handlers.live)
    app.router.add_get("/metrics", telemetry.metrics)
    app.router.add_get("/dashboard", dashboard.page)
    app.router.add_get("/dashboard/api/overview", dashboard.overview)
    app.router.add_get("/dashboard/api/traces/{trace_id}", dashboard.trace)
    app.router.add_get("/dashboard/api/sessions/{project}/{session:.+}", dashboard_sessions.session)
    app.router.add_static("/dashboard/static", STATIC_DIR)


def is_anthropic_path(path: str) -> bool:
    """Routes that answer in Anthropic's envelope: /anthropic/*, /v1/messages and what lies under
    it (count_tokens, and batches, which we do not serve, answered 404 in that envelope)."""
    return path.startswith(("/anthropic/", "/v1/messages/")) or path == "/v1/messages"
