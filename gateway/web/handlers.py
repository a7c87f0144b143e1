"""Thin HTTP handlers: each hands its dialect to the pipeline, or answers a small GET."""

from __future__ import annotations

import time
from functools import partial

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler

from auth.principal import AuthError, Scope
from gateway.dialects import AnthropicMessages, OpenAIChat, OpenAICompletions, OpenAIResponses
from gateway.dialects.base import Dialect
from gateway.dialects.openai_embeddings import OpenAIEmbeddings
from gateway.request.keeper import AnswerKeeper
from gateway.web import token_count
from gateway.web.credentials import authenticated
from gateway.web.keys import AUTHENTICATOR, FLEET, PIPELINE, SETTINGS

OPENAI_CHAT = OpenAIChat()
OPENAI_COMPLETIONS = OpenAICompletions()
OPENAI_RESPONSES = OpenAIResponses()
OPENAI_EMBEDDINGS = OpenAIEmbeddings()
ANTHROPIC_MESSAGES = AnthropicMessages()


def model_handler(app: web.Application, dialect: Dialect,
                  keeper: AnswerKeeper | None = None) -> Handler:
    """A model route's handler: the app's pipeline's own `handle` for `dialect` (a partial, not
    an `async def` around it: every resume of a request's coroutine chain, at each upstream wait
    and each streamed event, then passes one frame fewer)."""
    return partial(app[PIPELINE].handle, dialect=dialect, keeper=keeper)


async def count_tokens(request: web.Request) -> web.Response:
    return await token_count.count_tokens(request, request.app[PIPELINE], ANTHROPIC_MESSAGES)


async def list_models(request: web.Request) -> web.Response:
    """OpenAI `GET /v1/models`: the models this caller may call, with context length and prices.
    The Anthropic SDK (it always sends `anthropic-version`) gets Anthropic's form here too."""
    if _is_anthropic_client(request):
        return await anthropic_models(request)
    entries = await _visible_models(request, OPENAI_CHAT)
    if isinstance(entries, web.Response):
        return entries
    return _json({"object": "list", "data": entries})


async def retrieve_model(request: web.Request) -> web.Response:
    """OpenAI `GET /v1/models/{model}` (the SDK's `models.retrieve`); 404 for a model this caller
    cannot see, as for one that does not exist."""
    if _is_anthropic_client(request):
        return await anthropic_models(request)
    entries = await _visible_models(request, OPENAI_CHAT)
    if isinstance(entries, web.Response):
        return entries
    name = request.match_info["model"]
    for entry in entries:
        if entry["id"] == name:
            return _json(entry)
    return _json(OPENAI_CHAT.error_body(404, "model_not_found",
                                        f"the model {name!r} does not exist"),
                 404)


async def anthropic_models(request: web.Request) -> web.Response:
    """Anthropic `GET /v1/models[/{model}]` under /anthropic: the same models in Anthropic's
    form."""
    entries = await _visible_models(request, ANTHROPIC_MESSAGES)
    if isinstance(entries, web.Response):
        return entries
    models = [{"type": "model", "id": e["id"], "display_name": e["id"],
               "created_at": "1970-01-01T00:00:00Z"} for e in entries]
    name = request.match_info.get("model")
    if name is None:
        return _json({"data": models, "has_more": False,
                      "first_id": models[0]["id"] if models else None,
                      "last_id": models[-1]["id"] if models else None})
    for model in models:
        if model["id"] == name:
            return _json(model)
    return _json(ANTHROPIC_MESSAGES.error_body(404, "model_not_found",
                                               f"the model {name!r} does not exist"), 404)


def _is_anthropic_client(request: web.Request) -> bool:
    """The Anthropic SDKs send `anthropic-version` on every call; the OpenAI SDKs never do."""
    return "anthropic-version" in request.headers


async def _visible_models(request: web.Request, dialect: Dialect
                          ) -> list[dict[str, object]] | web.Response:
    """The OpenAI model entries the caller's credential may call, or its auth error answer (in
    the dialect's envelope)."""
    try:
        principal = await authenticated(request, request.app[AUTHENTICATOR])
        principal.require(Scope.INVOKE)
    except AuthError as exc:
        return _json(dialect.error_body(exc.status, exc.code, exc.message), exc.status)
    data: list[dict[str, object]] = []
    for name, route in request.app[FLEET].routes.items():
        if principal.allowed_models is not None and name not in principal.allowed_models:
            continue
        context_length = next((e.context_length for e in route.endpoints if e.context_length), None)
        prices = route.settings.prices
        data.append({"id": name, "object": "model", "created": 0,
                     "owned_by": route.settings.owned_by,
                     "context_length": context_length, "max_model_len": context_length,
                     "pricing": {"input_per_token": prices.input_per_token,
                                 "cached_input_per_token": prices.cached_input_per_token,
                                 "output_per_token": prices.output_per_token}})
    return data


def _json(body: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


async def health(request: web.Request) -> web.Response:
    """Readiness. 503 "draining" while shutting down, 503 "unready" once some model has had no
    endpoint that can serve for longer than `unready_after_s`, nor any model of its fallback
    chain (its requests could only fail); else 200: "degraded" when some model has no endpoint
    that can serve (yet within the grace, or its fallbacks serve its requests), "ok" otherwise.
    Per model: endpoint counts. Liveness is GET /health/live."""
    pipeline, fleet = request.app[PIPELINE], request.app[FLEET]
    models = {name: {"num_endpoints": len(route.endpoints),
                     "num_healthy_endpoints": sum(e.can_serve() for e in route.endpoints)}
              for name, route in fleet.routes.items()}
    now = time.monotonic()
    grace_s = request.app[SETTINGS].unready_after_s
    chains = pipeline.fallback_chains
    unready = any(min(fleet.unservable_for_s(model, now) for model in (name, *chains.get(name, ())))
                  > grace_s for name in models)
    degraded = any(m["num_healthy_endpoints"] == 0 for m in models.values())
    status = ("draining" if pipeline.draining else "unready" if unready
              else "degraded" if degraded else "ok")
    return web.Response(body=orjson.dumps({"status": status, "models": models}),
                        status=503 if pipeline.draining or unready else 200,
                        content_type="application/json")


async def live(request: web.Request) -> web.Response:
    """Liveness: 200 while the process serves HTTP (also while draining, or with every replica
    down: restarting the gateway would not bring one back)."""
    return web.Response(body=b'{"status":"live"}', content_type="application/json")
