"""Anthropic's `POST /v1/messages/count_tokens`: how many input tokens a Messages request costs.

    {"model": ..., "system": ..., "messages": [...], "tools": [...]}  ->  {"input_tokens": N}

The same checks as a Messages request before it is admitted (credential, invoke scope, body cap,
the dialect's validation, the model exists and the key may call it), then the model's backend
counts (`Backend.count_prompt_tokens`, off the event loop): a replica model exactly as the replica
will (its chat template, tools and tokenizer), an OpenAI-compatible one with its configured
tokenizer or the ~4-characters-a-token estimate. Nothing is metered and no upstream is called.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from auth.principal import AuthError, Scope
from gateway.dialects.anthropic_messages import AnthropicMessages
from gateway.errors import GatewayError, ModelNotFound
from gateway.pipeline import Pipeline, credential_of, error_response, read_json_body, request_id_of

log = logging.getLogger("aigw.gateway")


async def count_tokens(request: web.Request, pipeline: Pipeline, dialect: AnthropicMessages
                       ) -> web.Response:
    started = time.perf_counter()
    request_id = request_id_of(request)

    def failed(status: int, code: str, message: str) -> web.Response:
        return error_response(dialect, status, code, message, request_id,
                              (time.perf_counter() - started) * 1000.0)

    try:
        principal = await pipeline.authenticator.authenticate(credential_of(request))
        principal.require(Scope.INVOKE)
        body = await read_json_body(request, pipeline.settings.max_body_bytes)
        canonical = dialect.parse_count_tokens(body, request_id)
        principal.require_model(canonical.model)
        route = pipeline.fleet.get(canonical.model)
        if route is None or not route.endpoints:
            raise ModelNotFound(f"the model {canonical.model!r} does not exist")
        num_tokens = await asyncio.to_thread(route.backend.count_prompt_tokens, canonical,
                                             route.endpoints[0])
    except AuthError as exc:
        return failed(exc.status, exc.code, exc.message)
    except GatewayError as exc:
        return failed(exc.status, exc.code, exc.message)
    except Exception as exc:  # noqa: BLE001 - e.g. a chat template that rejects this conversation
        log.warning("count_tokens %s could not render the prompt: %r", request_id, exc)
        return failed(400, "invalid_request", f"the prompt cannot be rendered for this model: {exc}")
    response = web.json_response({"input_tokens": num_tokens})
    response.headers["x-request-id"] = request_id
    return response
