"""Anthropic's `POST /v1/messages/count_tokens`: how many input tokens a Messages request costs.

    {"model": ..., "system": ..., "messages": [...], "tools": [...]}  ->  {"input_tokens": N}

The same checks as a Messages request before it is admitted (`Pipeline.authorize`: credential,
invoke scope, body cap, the dialect's validation, the model exists and the key may call it), then
the model's backend
counts (`Backend.count_prompt_tokens`, off the event loop): a replica model exactly as the replica
will (its chat template, tools and tokenizer), an OpenAI-compatible one with its configured
tokenizer or the ~4-characters-a-token estimate. Nothing is metered and no upstream is called.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pydantic
from aiohttp import web

from auth.principal import AuthError
from gateway.dialects.anthropic_messages import AnthropicMessages
from gateway.errors import GatewayError, ModelNotFound
from gateway.pipeline import Pipeline, error_response, request_id_of

log = logging.getLogger("aigw.gateway")


async def count_tokens(request: web.Request, pipeline: Pipeline, dialect: AnthropicMessages
                       ) -> web.Response:
    started = time.perf_counter()
    request_id = request_id_of(request)

    def failed(status: int, code: str, message: str) -> web.Response:
        return error_response(dialect, status, code, message, request_id,
                              (time.perf_counter() - started) * 1000.0)

    try:
        canonical, _, route = await pipeline.authorize(request, dialect.parse_count_tokens,
                                                       request_id)
        if not route.endpoints:
            raise ModelNotFound(f"the model {canonical.model!r} has no endpoint")
        num_tokens = await asyncio.to_thread(route.backend.count_prompt_tokens, canonical,
                                             route.endpoints[0])
    except AuthError as exc:
        return failed(exc.status, exc.code, exc.message)
    except GatewayError as exc:
        return failed(exc.status, exc.code, exc.message)
    except pydantic.ValidationError as exc:  # the replica's own checks (e.g. tool_choice needs tools)
        return failed(400, "invalid_request", exc.errors()[0]["msg"].removeprefix("Value error, "))
    except Exception as exc:  # noqa: BLE001 - e.g. a chat template that rejects this conversation
        log.warning("count_tokens %s could not render the prompt: %r", request_id, exc)
        return failed(400, "invalid_request", f"the prompt cannot be rendered for this model: {exc}")
    response = web.json_response({"input_tokens": num_tokens})
    response.headers["x-request-id"] = request_id
    return response
