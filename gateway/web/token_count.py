"""Anthropic's `POST /v1/messages/count_tokens`: how many input tokens a Messages request costs.

    {"model": ..., "system": ..., "messages": [...], "tools": [...]}  ->  {"input_tokens": N}

The same checks and limits as a Messages request (`Pipeline.authorize`: credential, invoke
scope, body cap and body timeout, the dialect's validation, the model exists and the key may
call it; then the meter's admission, so requests-per-minute and tokens-per-minute limits apply,
with a reservation of the prompt's estimate and no completion), then the model's backend counts
(`Backend.count_prompt_tokens`, off the event loop): a replica model exactly as the replica will
(its chat template, tools and tokenizer, with the caller's cache salt: the segment cache it
warms is the caller's own), an OpenAI-compatible one with its configured tokenizer or the
~4-characters-a-token estimate. A prompt whose length alone proves it cannot fit the model's
context is refused (400 `context_length_exceeded`) without being encoded. No upstream is called;
the request settles one usage record with no tokens and no cost (so usage shows the calls, and
the reservation is released before the answer).
"""

from __future__ import annotations

import asyncio
import logging
import time

import pydantic
from aiohttp import web

from auth.principal import AuthError
from gateway.dialects.anthropic_messages import AnthropicMessages
from gateway.metering.contract import (
    MeterBacklogged,
    RateLimited,
    ReservationTooLarge,
    UsageRecord,
)
from gateway.request.admission import request_ids_of
from gateway.request.answer import error_response
from gateway.request.canonical import estimate_prompt_tokens
from gateway.request.errors import BadRequest, GatewayError, ModelNotFound
from gateway.request.observer import observer_of
from gateway.request.pipeline import Pipeline

log = logging.getLogger("aigw.gateway")


async def count_tokens(request: web.Request, pipeline: Pipeline, dialect: AnthropicMessages
                       ) -> web.Response:
    started = time.perf_counter()
    request_id, usage_id = request_ids_of(request)

    def failed(status: int, code: str, message: str,
               headers: dict[str, str] | None = None) -> web.Response:
        return error_response(dialect, status, code, message, request_id,
                              (time.perf_counter() - started) * 1000.0, headers=headers)

    try:
        if pipeline.draining:
            raise GatewayError("the gateway is shutting down", status=503, code="draining")
        canonical, principal, route = await pipeline.authorize(request, dialect.parse_count_tokens,
                                                               request_id)
        if not route.endpoints:
            raise ModelNotFound(f"the model {canonical.model!r} has no endpoint")
        canonical.project = principal.project
        canonical.cache_salt = pipeline.cache_salt_of(principal)
        canonical.observer.on_admitting(canonical.model, principal.project)
        try:
            admission = await pipeline.meter.admit(usage_id, principal, canonical.model,
                                                   estimate_prompt_tokens(canonical), 0)
        except ReservationTooLarge as exc:
            raise BadRequest(exc.message) from exc
        except MeterBacklogged as exc:  # back-pressure: the usage ledger cannot keep up
            raise GatewayError(exc.message, status=503, code="metering_backlogged") from exc
        canonical.observer.on_admitted()
    except AuthError as exc:
        return failed(exc.status, exc.code, exc.message)
    except GatewayError as exc:
        return failed(exc.status, exc.code, exc.message)
    except RateLimited as exc:
        return failed(429, "rate_limit_exceeded", exc.message, exc.headers)
    answer: web.Response | None = None
    status = 400
    try:
        num_tokens = await asyncio.to_thread(route.backend.count_prompt_tokens, canonical,
                                             route.endpoints[0])
        status = 200
    # the replica's own checks (e.g. tool_choice needs tools)
    except pydantic.ValidationError as exc:
        answer = failed(400, "invalid_request",
                        exc.errors()[0]["msg"].removeprefix("Value error, "))
    except Exception as exc:  # noqa: BLE001 - over the context, or a template that refuses it
        code = getattr(exc, "code", None)
        if code == "context_length_exceeded":
            answer = failed(400, code, str(exc))
        else:
            log.warning("count_tokens %s could not render the prompt: %r", request_id, exc)
            answer = failed(400, "invalid_request",
                            f"the prompt cannot be rendered for this model: {exc}")
    finally:
        record = UsageRecord(
            request_id=usage_id, project=principal.project, key_id=principal.key_id,
            model=route.settings.name, endpoint="", prompt_tokens=0, cached_tokens=0,
            completion_tokens=0, cost_usd=0.0, latency_ms=(time.perf_counter() - started) * 1000,
            status=status if answer is None else answer.status, created_at=time.time())
        await asyncio.shield(pipeline.settle(admission, record, observer_of(request)))
    if answer is not None:
        return answer
    response = web.json_response({"input_tokens": num_tokens}, headers=admission.headers)
    response.headers["x-request-id"] = request_id
    return response
