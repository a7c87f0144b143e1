"""Stored Responses conversations: what `store` keeps and `previous_response_id` reads back.

One stored body per response (orjson):

    {"response": <the response object as the client got it>,
     "input_items": <every input item of its conversation, oldest first, each with an id>,
     "session": <the conversation's session: the client's prompt_cache_key / x-session-id, else
                 its first response's id>}

where a continuation's `input_items` are its previous response's `input_items`, then that
response's `output` items, then its own `input`. A response is thus whole by itself: deleting or
losing an earlier turn never breaks a later one, at the price of a conversation's prefix being
stored once per turn (each body bounded by `max_response_bytes`). `instructions` are not items:
each request states its own (OpenAI: "the instructions from a previous response will not be
carried over").

Continuing from a stored response puts its items, re-read as messages, before the new input, so
the rendered prompt of turn n+1 starts with turn n's prompt and output: the prefix router sends it
to the replica that holds that KV, and the replica's prefix cache serves it (cached_tokens).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson

from auth.principal import Principal
from gateway.dialects.openai_responses import (
    ResponsesRequest,
    is_response_id,
    parse_items,
    response_id,
    with_instructions,
)
from gateway.request.canonical import CanonicalRequest
from gateway.request.errors import BadRequest, GatewayError
from gateway.request.keeper import AnswerKeeper
from gateway.responses_store.base import ResponseStore

log = logging.getLogger("aigw.gateway")

_PARSE_OFF_LOOP_BYTES = 1024 * 1024
_ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                     "reasoning": "rs"}


class NotStored(GatewayError):
    """No stored response by that id for this project (OpenAI's 404 wording)."""

    status = 404
    code = "not_found"

    def __init__(self, response_id: str) -> None:
        super().__init__(f"Response with id '{response_id[:64]}' not found.")


class StoreUnavailable(GatewayError):
    status = 503
    code = "responses_store_unavailable"


class StoredResponses(AnswerKeeper):
    """The Responses API's state over a `ResponseStore`: the pipeline's keeper, and the reads of
    GET/DELETE /v1/responses/{id} and its input_items."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def prepare(self, request: CanonicalRequest, principal: Principal) -> None:
        if not isinstance(request, ResponsesRequest):
            return
        if request.previous_response_id is None:
            if request.store:  # a new conversation: a session named by its first response
                _name_session(request, response_id(request))
            return
        previous_id = request.previous_response_id
        stored, num_bytes = await self._read_sized(principal.project, previous_id)
        if stored is None:
            raise BadRequest(f"Previous response with id '{previous_id[:64]}' not found.",
                             param="previous_response_id", code="previous_response_not_found")
        max_bytes = self.store.settings.max_response_bytes
        if request.store and num_bytes + len(orjson.dumps(request.input_items)) > max_bytes:
            raise BadRequest(f"this conversation is over the {max_bytes} bytes a stored response "
                             "may hold; start a new one, or continue with store: false",
                             param="previous_response_id", code="conversation_too_large")
        prior = [*stored["input_items"], *stored["response"].get("output", ())]
        own = _resolve_references(request.input_items, prior)
        request.context_items = prior
        request.input_items = own
        _name_session(request, stored.get("session"))
        request.messages = with_instructions(request, parse_items(prior + own,
                                                                  num_prior=len(prior)))

    async def keep(self, request: CanonicalRequest, answer: dict[str, Any]) -> None:
        if not isinstance(request, ResponsesRequest) or not request.store:
            return
        items = [*request.context_items, *_with_ids(request.input_items, request.id_hex)]
        body = orjson.dumps({"response": answer, "input_items": items,
                             "session": request.prompt_cache_key or request.session_id})
        try:
            if not await self.store.put(request.project or "", answer["id"], body):
                log.warning("response %s not stored: %d bytes is over "
                            "responses_store_max_response_bytes (%d)", answer["id"], len(body),
                            self.store.settings.max_response_bytes)
        except Exception:  # noqa: BLE001 - the answer goes out; it is just not retrievable
            log.exception("response %s not stored", answer["id"])

    async def retrieve(self, principal: Principal, response_id: str) -> dict[str, Any]:
        stored = await self._read(principal.project, response_id)
        if stored is None:
            raise NotStored(response_id)
        return stored["response"]  # type: ignore[no-any-return]

    async def delete(self, principal: Principal, response_id: str) -> dict[str, Any]:
        try:
            deleted = is_response_id(response_id) and await self.store.delete(principal.project,
                                                                              response_id)
        except Exception as exc:  # noqa: BLE001 - a store outage is a 503, not a traceback
            raise StoreUnavailable(f"the responses store cannot be reached: {exc!r}") from exc
        if not deleted:
            raise NotStored(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def input_items(self, principal: Principal, response_id: str, *, limit: int,
                          descending: bool, after: str | None) -> dict[str, Any]:
        """OpenAI's item list of one response's conversation, paged: up to `limit` items after
        the item `after` (an item id), newest first when `descending`."""
        stored = await self._read(principal.project, response_id)
        if stored is None:
            raise NotStored(response_id)
        items: list[dict[str, Any]] = stored["input_items"]
        if descending:
            items = items[::-1]
        start = 0
        if after is not None:
            start = next((i + 1 for i, item in enumerate(items) if item.get("id") == after), -1)
            if start < 0:
                raise BadRequest(f"no item with id {after[:64]!r} in this response's input",
                                 param="after")
        page = items[start:start + limit]
        return {"object": "list", "data": page, "has_more": start + limit < len(items),
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None}

    async def _read(self, project: str, response_id: str) -> dict[str, Any] | None:
        return (await self._read_sized(project, response_id))[0]

    async def _read_sized(self, project: str, response_id: str
                          ) -> tuple[dict[str, Any] | None, int]:
        """(the stored body, its size in bytes), or (None, 0)."""
        if not is_response_id(response_id):
            return None, 0  # (not ours: as unknown as an id that was never stored)
        try:
            body = await self.store.get(project, response_id)
        except Exception as exc:  # noqa: BLE001 - a store outage is a 503, not a traceback
            raise StoreUnavailable(f"the responses store cannot be reached: {exc!r}") from exc
        if body is None:
            return None, 0
        if len(body) > _PARSE_OFF_LOOP_BYTES:  # (a long conversation: ~10 ms a MiB to parse)
            return await asyncio.to_thread(orjson.loads, body), len(body)
        return orjson.loads(body), len(body)

    async def close(self) -> None:
        await self.store.close()


def _name_session(request: ResponsesRequest, session: str | None) -> None:
    """A stored conversation is one session (routing affinity, KV retention between turns, the
    usage report's `session`), unless the client names its own (prompt_cache_key, x-session-id)."""
    if session and request.prompt_cache_key is None and request.session_id is None:
        request.session_id = session


def _resolve_references(items: list[dict[str, Any]], prior: list[dict[str, Any]]
                        ) -> list[dict[str, Any]]:
    """`input` with each `item_reference` replaced by the stored item of that id (an item of the
    conversation being continued); 400 for one that names none."""
    if not any(item.get("type") == "item_reference" for item in items):
        return items
    by_id = {item["id"]: item for item in prior if isinstance(item.get("id"), str)}
    resolved = []
    for i, item in enumerate(items):
        if item.get("type") == "item_reference":
            found = by_id.get(item.get("id"))
            if found is None:
                raise BadRequest(f"input[{i}]: item {str(item.get('id'))[:64]!r} is not in the "
                                 "previous response's conversation", param=f"input[{i}].id")
            item = found
        resolved.append(item)
    return resolved


def _with_ids(items: list[dict[str, Any]], id_hex: str) -> list[dict[str, Any]]:
    """The request's input items as input_items lists them: each with an id (its own, else
    `<kind>_<response hex>_<index>`) and a message's string content as one text part."""
    out = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        item = dict(item, type=kind)
        if not isinstance(item.get("id"), str):
            item["id"] = f"{_ITEM_ID_PREFIXES.get(kind, 'item')}_{id_hex}_{i}"
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        if kind in ("message", "function_call", "function_call_output"):
            item.setdefault("status", "completed")
        out.append(item)
    return out
