"""Thin handlers for stored Responses API answers (gateway/responses_store/conversation.py):

    GET    /v1/responses/{response_id}               the response object (?stream=true: its events)
    DELETE /v1/responses/{response_id}               {"id", "object": "response", "deleted": true}
    GET    /v1/responses/{response_id}/input_items   ?limit=1..100 (20) &order=asc|desc (desc)
                                                     &after=<item id>

Each needs the invoke scope and sees only its own project's responses: another project's id, a
deleted or expired one, and one never stored are the same 404, in OpenAI's envelope.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from auth.principal import AuthError, Principal, Scope
from gateway.dialects import openai_common, openai_responses
from gateway.request.errors import BadRequest, GatewayError
from gateway.web.credentials import authenticated
from gateway.web.keys import AUTHENTICATOR, RESPONSES


async def retrieve(request: web.Request) -> web.Response:
    """The response object; with `?stream=true` the events that make it (`starting_after`: from
    the event after that sequence number)."""
    stream = request.query.get("stream", "false").lower()
    if stream not in ("true", "1", "false", "0"):
        return _error(BadRequest("stream: expected true or false", param="stream"))
    if stream in ("false", "0"):
        async def answer(principal: Principal, response_id: str) -> dict[str, Any]:
            return await request.app[RESPONSES].retrieve(principal, response_id)

        return await _answer(request, answer)
    streamed: list[bytes] = []

    async def events(principal: Principal, response_id: str) -> dict[str, Any]:
        after = request.query.get("starting_after")
        if after is not None and not _is_count(after):
            raise BadRequest("starting_after: expected a sequence number", param="starting_after")
        stored = await request.app[RESPONSES].retrieve(principal, response_id)
        streamed.append(openai_responses.replay(stored, None if after is None else int(after)))
        return stored

    answered = await _answer(request, events)
    if not streamed:
        return answered  # the refusal
    return web.Response(body=streamed[0], content_type="text/event-stream",
                        headers={"cache-control": "no-cache"})


async def delete(request: web.Request) -> web.Response:
    async def answer(principal: Principal, response_id: str) -> dict[str, Any]:
        return await request.app[RESPONSES].delete(principal, response_id)

    return await _answer(request, answer)


async def input_items(request: web.Request) -> web.Response:
    async def answer(principal: Principal, response_id: str) -> dict[str, Any]:
        query = request.query
        limit = _limit(query.get("limit", "20"))
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise BadRequest("order: expected 'asc' or 'desc'", param="order")
        return await request.app[RESPONSES].input_items(
            principal, response_id, limit=limit, descending=order == "desc",
            after=query.get("after") or None)

    return await _answer(request, answer)


def _error(exc: GatewayError) -> web.Response:
    body = openai_common.error_body(exc.status, exc.code, exc.message, exc.param, exc.error_type)
    return web.Response(body=orjson.dumps(body), status=exc.status, content_type="application/json")


def _is_count(text: str) -> bool:
    """ASCII digits that int() reads: str.isdigit() is also true of '²' (int() refuses it) and
    of a 5,000-digit string (over int()'s 4,300): both were 500s."""
    return text.isascii() and text.isdigit() and len(text) <= 18


def _limit(value: str) -> int:
    if not _is_count(value) or not 1 <= int(value) <= 100:
        raise BadRequest("limit: expected an integer from 1 to 100", param="limit")
    return int(value)


async def _answer(request: web.Request,
                  answer: Callable[[Principal, str], Awaitable[dict[str, Any]]]) -> web.Response:
    """Authenticate (invoke scope), then `answer`; any refusal in OpenAI's error envelope."""
    try:
        principal = await authenticated(request, request.app[AUTHENTICATOR])
        principal.require(Scope.INVOKE)
        body, status = await answer(principal, request.match_info["response_id"]), 200
    except AuthError as exc:
        body, status = openai_common.error_body(exc.status, exc.code, exc.message), exc.status
    except GatewayError as exc:
        body = openai_common.error_body(exc.status, exc.code, exc.message, exc.param,
                                        exc.error_type)
        status = exc.status
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")
