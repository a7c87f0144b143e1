"""OpenAI Responses API: POST /v1/responses (and /openai/v1/responses). The answers are stored
(`store`, true by default) by gateway/responses_store/, which also resolves `previous_response_id`
(the stored conversation comes before `input`); this module stays free of I/O: it parses the
request, names the ids, and writes the response object. `conversation` is refused.

Stream events: response.created, response.in_progress, then per output item
output_item.added -> (content_part.added, output_text.delta*, output_text.done, content_part.done |
content_part.added, reasoning_text.delta*, reasoning_text.done, content_part.done |
function_call_arguments.delta*, function_call_arguments.done) -> output_item.done, and finally
response.completed (or `event: error` with an `error` object when the upstream fails mid-stream).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.dialects import openai_common as common
from gateway.dialects.base import Dialect, StreamEncoder
from gateway.dialects.openai_chat import parse_content
from gateway.dialects.validate import (
    InvalidParam,
    ToolResults,
    check_sampling,
    get_bool,
    get_int,
    get_list,
    get_number,
    get_object,
    get_str,
    get_tool_name,
    get_tool_schema,
    need_object,
)
from gateway.request.canonical import (
    CanonicalEvent,
    CanonicalRequest,
    CanonicalResponse,
    Message,
    PromptUsage,
    ReasoningDelta,
    TextDelta,
    Tool,
    ToolCall,
    ToolCallDelta,
    Usage,
)

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def input_items(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`input` as a list of items (a string is one user message); shapes are checked by
    `parse_items`."""
    value = body.get("input")
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    items = get_list(body, "input", required=True, non_empty=True) or []
    return [need_object(item, f"input[{i}]") for i, item in enumerate(items)]


def parse_items(items: list[dict[str, Any]], *, num_prior: int = 0,
                check_results: bool = True) -> list[Message]:
    """The conversation of `items`: the first `num_prior` are a stored conversation's (an error
    there names `previous_response_id`), the rest the request's `input`. `check_results` False:
    a function call output may answer a call not among `items` (one of the stored conversation,
    checked once that is known)."""
    messages: list[Message] = []
    results = ToolResults(is_adjacent=False)
    reasoning = ""  # a reasoning item's text, for the assistant turn that follows it
    for i, item in enumerate(items):
        where = f"input[{i - num_prior}]" if i >= num_prior else "previous_response_id"
        kind = item.get("type", "message")
        if kind == "reasoning":
            reasoning += _reasoning_text(item, where)
            continue
        if kind == "item_reference":
            raise InvalidParam(f"{where}.type", "item references are not supported; send the "
                               "item, or continue with previous_response_id")
        if not (kind == "function_call" or kind == "message" and item.get("role") == "assistant"):
            reasoning = ""  # only an assistant turn right after it takes the reasoning (below)
        if kind == "message":
            role = _ROLES.get(get_str(item, "role", f"{where}.role", required=True) or "")
            if role is None:
                raise InvalidParam(f"{where}.role", f"unknown role {item.get('role')!r}")
            messages.append(Message(role, parse_content(item.get("content"),  # type: ignore[arg-type]
                                                        f"{where}.content"),
                                    reasoning=reasoning if role == "assistant" else ""))
            reasoning = ""
        elif kind == "function_call":
            call = ToolCall(get_str(item, "call_id", f"{where}.call_id", required=True) or "",
                            get_tool_name(item, "name", f"{where}.name"),
                            get_str(item, "arguments", f"{where}.arguments") or "{}")
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":  # the same turn: text, then calls
                messages[-1] = Message("assistant", last.content, (*last.tool_calls, call),
                                       reasoning=last.reasoning + reasoning)
            else:
                messages.append(Message("assistant", "", (call,), reasoning=reasoning))
            reasoning = ""
            results.add(messages[-1], where)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(Message("tool", parse_content(output, f"{where}.output"),
                                    tool_call_id=get_str(item, "call_id", f"{where}.call_id",
                                                         required=True)))
            if check_results:
                results.add(messages[-1], f"{where}.call_id")
        else:
            raise InvalidParam(f"{where}.type", f"unsupported input item {kind!r}")
    if not messages:
        raise InvalidParam("input", "needs at least one message or function call item "
                           "(reasoning items only go with them)")
    return messages


def with_instructions(request: CanonicalRequest, messages: list[Message]) -> list[Message]:
    """`instructions` as the leading system message (never a stored turn's: each request
    states its own, as OpenAI's previous_response_id does)."""
    instructions = request.instructions if isinstance(request, ResponsesRequest) else None
    return ([Message("system", instructions)] if instructions else []) + messages


def _reasoning_text(item: dict[str, Any], param: str) -> str:
    """A reasoning input item's text: its `reasoning_text` content, else its summary."""
    parts = get_list(item, "content", f"{param}.content") or get_list(
        item, "summary", f"{param}.summary") or ()
    texts = []
    for j, part in enumerate(parts):
        part = need_object(part, f"{param}.content[{j}]")
        texts.append(get_str(part, "text", f"{param}.content[{j}].text") or "")
    return "".join(texts)


def _parse_tools(body: dict[str, Any]) -> list[Tool]:
    tools = []
    for i, raw in enumerate(get_list(body, "tools") or ()):
        raw = need_object(raw, f"tools[{i}]")
        if raw.get("type") != "function":
            raise InvalidParam(f"tools[{i}].type", "only 'function' tools are supported")
        tools.append(Tool(get_tool_name(raw, "name", f"tools[{i}].name"),
                          get_str(raw, "description", f"tools[{i}].description") or "",
                          get_tool_schema(raw, "parameters", f"tools[{i}].parameters")))
    return tools


def _parse_tool_choice(value: Any) -> str | dict[str, Any] | None:
    if value is None or value in ("none", "auto", "required"):
        return value  # type: ignore[no-any-return]
    if (isinstance(value, dict) and value.get("type") == "function"
        and isinstance(value.get("name"), str)):
        return {"type": "function", "function": {"name": value["name"]}}
    raise InvalidParam("tool_choice", "expected 'none', 'auto', 'required' or a function choice")


def _tool_choice_json(tool_choice: str | dict[str, Any] | None) -> str | dict[str, Any]:
    """The Responses form of the canonical (chat-form) choice: a named function is
    {"type": "function", "name": ...}, as the client sent it."""
    if tool_choice is None:
        return "auto"
    if isinstance(tool_choice, dict):
        return {"type": "function", "name": tool_choice["function"]["name"]}
    return tool_choice


def _usage(usage: Usage | None) -> dict[str, Any]:
    """The Responses usage object; `cache_write_tokens` is 0: a prefix-cache write is not billed
    (nor counted) apart from the prompt's input tokens."""
    usage = usage or Usage(0, 0)
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
            "total_tokens": usage.total_tokens}


def _reasoning_item(request: CanonicalRequest, index: int, text: str, status: str
                    ) -> dict[str, Any]:
    """A reasoning item as OpenAI's Responses API gives an open-weight model's: the raw text as
    `reasoning_text` content, no summary (none is made)."""
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"type": "reasoning", "id": f"rs_{_hex(request)}_{index}", "summary": [],
            "content": content, "encrypted_content": None, "status": status}


def _text_part(text: str) -> dict[str, Any]:
    """An `output_text` content part (no token logprobs: the Responses API here returns none)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(request: CanonicalRequest, text: str, status: str) -> dict[str, Any]:
    content = [_text_part(text)] if status == "completed" else []
    return {"type": "message", "id": f"msg_{_hex(request)}", "status": status,
            "role": "assistant", "content": content}


def _call_item(request: CanonicalRequest, index: int, call: ToolCall,
               status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{_hex(request)}_{index}", "call_id": call.id,
            "name": call.name, "arguments": call.arguments if status == "completed" else "",
            "status": status}


def _response(request: CanonicalRequest, response: CanonicalResponse | None) -> dict[str, Any]:
    output: list[dict[str, Any]] = []
    status = "in_progress"
    incomplete = None
    if response is not None:
        status = "completed"
        if response.finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        if response.reasoning:
            output.append(_reasoning_item(request, 0, response.reasoning, "completed"))
        if response.text:
            output.append(_message_item(request, response.text, "completed"))
        output += [_call_item(request, i, c, "completed")
                   for i, c in enumerate(response.tool_calls)]
    stated = request if isinstance(request, ResponsesRequest) else ResponsesRequest("", "")
    return {"id": response_id(request), "object": "response", "created_at": stated.created_at,
            "status": status, "error": None, "incomplete_details": incomplete,
            "instructions": stated.instructions, "max_output_tokens": request.max_tokens,
            "model": request.model, "output": output,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": stated.previous_response_id, "store": stated.store,
            "temperature": request.temperature, "top_p": request.top_p,
            "tool_choice": _tool_choice_json(request.tool_choice),
            "tools": [{"type": "function", "name": t.name, "description": t.description,
                       "parameters": t.parameters, "strict": False} for t in request.tools],
            "text": {"format": _text_format_json(request.response_format)},
            "reasoning": {"effort": request.reasoning_effort, "summary": None},
            "truncation": "disabled", "metadata": stated.metadata,
            "service_tier": request.service_tier or "default",
            # no usage before the end (the spec's `usage` is an object or absent, never null)
            **({"usage": _usage(response.usage)} if response is not None else {})}


def _text_format_json(response_format: dict[str, Any] | None) -> dict[str, Any]:
    """`text.format` as the Responses API echoes it: chat's nested json_schema made flat."""
    if response_format is None:
        return {"type": "text"}
    return {"type": response_format["type"], **response_format.get("json_schema", {})}


def _hex(request: CanonicalRequest) -> str:
    """The response's own random part, which its item ids share (not the request id: clients
    reuse x-request-id, and stored ids must not collide)."""
    return request.id_hex if isinstance(request, ResponsesRequest) else request.request_id


def response_id(request: CanonicalRequest) -> str:
    return f"resp_{_hex(request)}"


def is_response_id(value: str) -> bool:
    """The form of the ids this dialect makes (`resp_` and 32 hex digits)."""
    return len(value) == 37 and value.startswith("resp_") and all(
        c in "0123456789abcdef" for c in value[5:])


def _parse_metadata(body: dict[str, Any]) -> dict[str, str]:
    """OpenAI's `metadata`: at most 16 string pairs, keys up to 64 and values up to 512 chars."""
    metadata = get_object(body, "metadata") or {}
    if len(metadata) > 16:
        raise InvalidParam("metadata", "at most 16 key-value pairs")
    for key, value in metadata.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise InvalidParam(f"metadata.{key[:64]}", "keys are strings of at most 64 "
                               "characters, values strings of at most 512")
    return dict(metadata)


@dataclass(slots=True)
class ResponsesRequest(CanonicalRequest):
    """The canonical request plus the Responses API's own state: what the response object
    echoes, whether it is stored, and the conversation as items (for the store)."""

    instructions: str | None = None
    id_hex: str = field(default_factory=lambda: secrets.token_hex(16))
    created_at: int = field(default_factory=lambda: int(time.time()))
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    input_items: list[dict[str, Any]] = field(default_factory=list)  # this request's `input`
    # the stored conversation before `input` (previous_response_id's items and output); set by
    # the store (gateway/responses_store/conversation.py) before admission
    context_items: list[dict[str, Any]] = field(default_factory=list)


class OpenAIResponses(Dialect):
    name = "openai"

    def parse(self, body: Any, request_id: str) -> CanonicalRequest:
        body = need_object(body, "body")
        request = ResponsesRequest(request_id, get_str(body, "model", required=True,
                                                       allow_empty=False) or "")
        if body.get("conversation") is not None:  # its stored items would precede `input`
            raise InvalidParam("conversation", "conversations are not supported; continue with "
                               "previous_response_id or send the conversation as input items")
        request.previous_response_id = get_str(body, "previous_response_id", allow_empty=False)
        store = get_bool(body, "store")
        request.store = store is not False
        request.metadata = _parse_metadata(body)
        request.instructions = get_str(body, "instructions")
        request.input_items = input_items(body)
        if request.previous_response_id is None:
            request.messages = with_instructions(request, parse_items(request.input_items))
        else:  # shapes checked now; the conversation once the store has read it
            own = [item for item in request.input_items if item.get("type") != "item_reference"]
            if own:
                parse_items(own, check_results=False)
        request.tools = _parse_tools(body)
        request.tool_choice = _parse_tool_choice(body.get("tool_choice"))
        request.parallel_tool_calls = get_bool(body, "parallel_tool_calls")
        request.max_tokens = get_int(body, "max_output_tokens", minimum=1)
        request.temperature = get_number(body, "temperature", minimum=0.0, maximum=2.0)
        request.top_p = get_number(body, "top_p", minimum=0.0, maximum=1.0)
        request.stream = bool(get_bool(body, "stream"))
        request.user = get_str(body, "user")
        request.prompt_cache_key = get_str(body, "prompt_cache_key")
        request.cache_retention_s = common.parse_cache_retention(body)
        request.service_tier = common.parse_service_tier(body)
        reasoning = get_object(body, "reasoning")
        if reasoning is not None:
            request.reasoning_effort = common.parse_reasoning_effort(reasoning.get("effort"),
                                                                     "reasoning.effort")
        check_sampling(request, {"max_tokens": "max_output_tokens"})
        text = get_object(body, "text")
        if text is not None:
            request.response_format = common.parse_output_format(text.get("format"), "text.format",
                                                                 is_flat=True)
        return request

    def render(self, request: CanonicalRequest, response: CanonicalResponse) -> dict[str, Any]:
        return _response(request, response)

    def encoder(self, request: CanonicalRequest) -> StreamEncoder:
        return _ResponsesEncoder(request)

    def error_body(self, status: int, code: str, message: str, param: str | None = None,
                   error_type: str | None = None) -> dict[str, Any]:
        # an upstream's 400 names chat parameters (context_length_exceeded: "messages")
        param = _UPSTREAM_PARAMS.get(param, param) if param is not None else None
        return common.error_body(status, code, message, param, error_type)


_UPSTREAM_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens",
                    "max_completion_tokens": "max_output_tokens"}


def replay(stored: dict[str, Any], starting_after: int | None = None) -> bytes:
    """A stored response object as the stream of events that makes it (`GET
    /v1/responses/{id}?stream=true`): created, in_progress, each output item whole in one delta,
    then response.completed / .incomplete / .failed carrying the object itself; the events
    numbered up to `starting_after` left out."""
    request = ResponsesRequest("", str(stored.get("model") or ""), id_hex=str(stored["id"])[5:])
    encoder = _ResponsesEncoder(request, stored)
    out = [encoder.start()]
    num_calls = 0
    for item in stored.get("output") or ():
        kind = item.get("type")
        parts = "".join(str(part.get("text") or "") for part in item.get("content") or ())
        if kind == "reasoning":
            out.append(encoder.event(ReasoningDelta(parts)))
        elif kind == "message":
            out.append(encoder.event(TextDelta(parts)))
        elif kind == "function_call":
            out.append(encoder.event(ToolCallDelta(num_calls, str(item.get("call_id") or ""),
                                                   str(item.get("name") or ""),
                                                   str(item.get("arguments") or ""))))
            num_calls += 1
    out.append(encoder.end_replay())
    events = b"".join(out).split(b"\n\n")[:-1]
    if starting_after is not None:
        events = events[starting_after + 1:]  # (event i has sequence_number i)
    return b"".join(event + b"\n\n" for event in events)


class _ResponsesEncoder(StreamEncoder):
    def __init__(self, request: CanonicalRequest, stored: dict[str, Any] | None = None) -> None:
        self._request = request
        self._stored = stored  # replaying a stored response: its object, not the request's
        self._sequence_number = 0
        self._num_items = 0
        self._done_items: list[dict[str, Any]] = []  # in stream order: response.completed's output
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._call_index: int | None = None  # the ToolCallDelta index of the last call item
        self._text: list[str] = []
        self._args: list[str] = []
        self._final: dict[str, Any] | None = None  # the last event's response object

    def _emit(self, kind: str, **fields: Any) -> bytes:
        fields["type"] = kind
        fields["sequence_number"] = self._sequence_number
        self._sequence_number += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(fields) + b"\n\n"

    def start(self, prompt: PromptUsage | None = None) -> bytes:
        snapshot = _response(self._request, None)
        if self._stored is not None:
            snapshot = {key: value for key, value in self._stored.items() if key != "usage"}
            snapshot.update(status="in_progress", output=[], error=None, incomplete_details=None)
        return (self._emit("response.created", response=snapshot)
                + self._emit("response.in_progress", response=snapshot))

    def _open_item(self, item: dict[str, Any]) -> bytes:
        out = self._close_item()
        self._open = item
        out += self._emit("response.output_item.added", output_index=self._num_items, item=item)
        if item["type"] == "message":
            out += self._emit("response.content_part.added", item_id=item["id"],
                              output_index=self._num_items, content_index=0,
                              part=_text_part(""))
        elif item["type"] == "reasoning":
            out += self._emit("response.content_part.added", item_id=item["id"],
                              output_index=self._num_items, content_index=0,
                              part={"type": "reasoning_text", "text": ""})
        return out

    def _close_item(self) -> bytes:
        item, self._open = self._open, None
        if item is None:
            return b""
        index = self._num_items
        self._num_items += 1
        if item["type"] == "message":
            text, self._text = "".join(self._text), []
            part = _text_part(text)
            done = dict(item, status="completed", content=[part])
            self._done_items.append(done)
            return (self._emit("response.output_text.done", item_id=item["id"], output_index=index,
                               content_index=0, text=text, logprobs=[])
                    + self._emit("response.content_part.done", item_id=item["id"],
                                 output_index=index, content_index=0, part=part)
                    + self._emit("response.output_item.done", output_index=index, item=done))
        if item["type"] == "reasoning":
            text, self._text = "".join(self._text), []
            part = {"type": "reasoning_text", "text": text}
            done = dict(item, status="completed", content=[part])
            self._done_items.append(done)
            return (self._emit("response.reasoning_text.done", item_id=item["id"],
                               output_index=index, content_index=0, text=text)
                    + self._emit("response.content_part.done", item_id=item["id"],
                                 output_index=index, content_index=0, part=part)
                    + self._emit("response.output_item.done", output_index=index, item=done))
        arguments, self._args = "".join(self._args) or "{}", []
        done = dict(item, status="completed", arguments=arguments)
        self._done_items.append(done)
        return (self._emit("response.function_call_arguments.done", item_id=item["id"],
                           output_index=index, name=item["name"], arguments=arguments)
                + self._emit("response.output_item.done", output_index=index, item=done))

    def event(self, event: CanonicalEvent) -> bytes:
        out = b""
        if isinstance(event, ReasoningDelta):
            if self._open is None or self._open["type"] != "reasoning":
                out += self._open_item(_reasoning_item(self._request, self._num_items, "",
                                                       "in_progress"))
            self._text.append(event.text)
            assert self._open is not None
            return out + self._emit("response.reasoning_text.delta", item_id=self._open["id"],
                                    output_index=self._num_items, content_index=0,
                                    delta=event.text)
        if isinstance(event, TextDelta):
            if self._open is None or self._open["type"] != "message":
                item = _message_item(self._request, "", "in_progress")
                if any(done["type"] == "message" for done in self._done_items):
                    item["id"] += f"_{self._num_items}"  # text again after a call: a new item
                out += self._open_item(item)
            self._text.append(event.text)
            assert self._open is not None
            return out + self._emit("response.output_text.delta", item_id=self._open["id"],
                                    output_index=self._num_items, content_index=0,
                                    delta=event.text, logprobs=[])
        if isinstance(event, ToolCallDelta):
            # a new call: a piece with an id, or of another index (an upstream may send no ids)
            if (event.id or self._open is None or self._open["type"] != "function_call"
                    or event.index != self._call_index):
                self._call_index = event.index
                call = ToolCall(event.id or f"call_{event.index}", event.name or "", "")
                out += self._open_item(_call_item(self._request, event.index, call, "in_progress"))
            self._args.append(event.arguments)
            assert self._open is not None
            if event.arguments:
                out += self._emit("response.function_call_arguments.delta",
                                  item_id=self._open["id"],
                                  output_index=self._num_items, delta=event.arguments)
        return out

    def finish(self, response: CanonicalResponse) -> bytes:
        snapshot = _response(self._request, response)
        kind = "response.incomplete" if snapshot["status"] == "incomplete" else "response.completed"
        out = self._close_item()
        if self._done_items:  # the items as streamed, in their output_index order
            snapshot["output"] = self._done_items
        self._final = snapshot
        return out + self._emit(kind, response=snapshot)

    def error(self, status: int, code: str, message: str) -> bytes:
        error = common.error_body(status, code, message)["error"]
        # the response as far as it came, `failed` (what a stored response says of it)
        self._final = dict(_response(self._request, None), status="failed",
                           error={"code": code, "message": message}, output=self._done_items)
        return self._emit("error", code=code, message=message, param=None, error=error)

    def answer(self) -> dict[str, Any] | None:
        return self._final

    def end_replay(self) -> bytes:
        """A replay's last events: the open item closed, then the stored object."""
        assert self._stored is not None
        status = self._stored.get("status")
        kind = {"incomplete": "response.incomplete", "failed": "response.failed"}.get(
            str(status), "response.completed")
        return self._close_item() + self._emit(kind, response=self._stored)
