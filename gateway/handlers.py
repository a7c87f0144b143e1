"""Thin HTTP handlers: each hands its dialect to the pipeline, or answers a small GET."""

from __future__ import annotations

import orjson
from aiohttp import web

from auth.principal import AuthError, Scope
from gateway.dialects import AnthropicMessages, OpenAIChat, OpenAICompletions, OpenAIResponses
from gateway.dialects.openai_common import error_body
from gateway.keys import AUTHENTICATOR, FLEET, PIPELINE
from gateway.pipeline import credential_of

OPENAI_CHAT = OpenAIChat()
OPENAI_COMPLETIONS = OpenAICompletions()
OPENAI_RESPONSES = OpenAIResponses()
ANTHROPIC_MESSAGES = AnthropicMessages()


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await request.app[PIPELINE].handle(request, OPENAI_CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    return await request.app[PIPELINE].handle(request, OPENAI_COMPLETIONS)


async def responses(request: web.Request) -> web.StreamResponse:
    return await request.app[PIPELINE].handle(request, OPENAI_RESPONSES)


async def messages(request: web.Request) -> web.StreamResponse:
    return await request.app[PIPELINE].handle(request, ANTHROPIC_MESSAGES)


async def list_models(request: web.Request) -> web.Response:
    try:
        principal = await request.app[AUTHENTICATOR].authenticate(credential_of(request))
        principal.require(Scope.INVOKE)
    except AuthError as exc:
        return web.json_response(error_body(exc.status, exc.code, exc.message), status=exc.status,
                                 dumps=lambda o: orjson.dumps(o).decode())
    data = []
    for name, route in request.app[FLEET].routes.items():
        if principal.allowed_models is not None and name not in principal.allowed_models:
            continue
        context_length = next((e.context_length for e in route.endpoints if e.context_length), None)
        prices = route.settings.prices
        data.append({"id": name, "object": "model", "created": 0, "owned_by": route.settings.owned_by,
                     "context_length": context_length, "max_model_len": context_length,
                     "pricing": {"input_per_token": prices.input_per_token,
                                 "cached_input_per_token": prices.cached_input_per_token,
                                 "output_per_token": prices.output_per_token}})
    return web.Response(body=orjson.dumps({"object": "list", "data": data}),
                        content_type="application/json")


async def health(request: web.Request) -> web.Response:
    """503 "draining" while shutting down; else 200, "degraded" when some model has no endpoint
    that can serve (not 503: liveness probes read this too, and a replica outage must not restart
    the gateway), "ok" otherwise. Per model: endpoint counts."""
    pipeline = request.app[PIPELINE]
    models = {name: {"num_endpoints": len(route.endpoints),
                     "num_healthy_endpoints": sum(e.can_serve() for e in route.endpoints)}
              for name, route in request.app[FLEET].routes.items()}
    degraded = any(m["num_healthy_endpoints"] == 0 for m in models.values())
    status = "draining" if pipeline.draining else "degraded" if degraded else "ok"
    return web.Response(body=orjson.dumps({"status": status, "models": models}),
                        status=503 if pipeline.draining else 200, content_type="application/json")
