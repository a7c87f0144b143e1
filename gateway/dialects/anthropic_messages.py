"""Anthropic Messages: POST /anthropic/v1/messages and /v1/messages.

Mapping to the canonical form:
  system (string or text blocks)       -> a leading system message
  user text blocks                     -> a user message; `tool_result` blocks -> tool messages
                                          (placed before the user's text, as they answer the
                                          previous assistant turn)
  assistant text + `tool_use` blocks   -> one assistant message with tool calls (input -> JSON text)
  tools[].input_schema                 -> Tool.parameters;  tool_choice auto/any/tool/none ->
                                                            OpenAI's
  cache_control on blocks              -> kept per message for a native Anthropic upstream
                                          (backends/anthropic.py); its longest ttl ("5m" /
                                          "1h", anywhere: top level, system, tools, messages)
                                          -> cache_retention_s (our replicas keep the prefix)
  a last assistant message with text   -> prefill: continue_final_message, the answer continues it
  output_config.format (json_schema)    -> response_format json_schema: the replica constrains
                                           decoding
  thinking disabled / enabled           -> chat_template_kwargs enable_thinking false / true
                                           (Qwen3),
                                          budget_tokens -> reasoning_effort (gpt-oss)
  assistant `thinking` blocks           -> the message's reasoning (sent back upstream)
The answer's reasoning is a leading `thinking` block (streamed as thinking_delta, then its
signature_delta), its `signature` an opaque digest of the text.
Usage: `cache_read_input_tokens` = cached prompt tokens; `input_tokens` = prompt tokens NOT read
from cache (Anthropic's definition: input_tokens + cache_read + cache_creation = whole prompt);
`cache_creation_input_tokens` = 0. While streaming, message_start carries the input and
cache-read tokens when the upstream announced them as it started (our replicas do, in the
stream's headers; else 0) and message_delta carries the final input/cache/output counts.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import replace
from typing import Any

import orjson

from gateway.dialects.base import Dialect, StreamEncoder
from gateway.dialects.validate import (
    InvalidParam,
    ToolResults,
    check_sampling,
    get_bool,
    get_int,
    get_list,
    get_number,
    get_object,
    get_stop,
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
from gateway.request.errors import GatewayError

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                 "content_filter": "refusal", "error": "end_turn"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 504: "timeout_error"}


def _stop_reason(response: CanonicalResponse) -> str:
    """"stop_sequence" when the upstream said which stop string matched, else by finish reason."""
    if response.finish_reason == "stop" and response.stop_sequence:
        return "stop_sequence"
    return _STOP_REASONS.get(response.finish_reason or "stop", "end_turn")


THREAD_NOT_FOUND = "thread_not_found"


def error_body(status: int, code: str, message: str) -> dict[str, Any]:
    """Anthropic's error types by status; another 4xx (e.g. 405) is an `invalid_request_error`, as
    Anthropic documents, and `api_error` is kept for the 5xx that have no type of their own. A
    code the SDK acts on is also in Anthropic's `details.error_code`."""
    default = "invalid_request_error" if 400 <= status < 500 else "api_error"
    error: dict[str, Any] = {"type": _ERROR_TYPES.get(status, default), "message": message,
                             "code": code}
    if code == THREAD_NOT_FOUND:
        error["details"] = {"error_code": code}
    return {"type": "error", "error": error}


def _check_thread(value: Any) -> None:
    """Message threads (the conversation kept by the server between turns; the SDK's tool runner
    uses them by default): nothing is stored here, so `create` is answered like a request
    without a thread, and `continue` is Anthropic's 404 thread_not_found, on which the SDK
    sends the whole conversation again under a new thread."""
    if value is None or value is False:
        return
    thread = need_object(value, "thread")
    if thread.get("type") == "continue":
        raise GatewayError("no thread to continue: this gateway stores no conversation; send the "
                           "whole conversation (thread create, or no thread)", status=404,
                           code=THREAD_NOT_FOUND)


def _text_of(value: Any, param: str) -> str:
    if isinstance(value, str):
        return value
    texts = []
    for i, block in enumerate(get_list({"v": value}, "v", param) or ()):
        block = need_object(block, f"{param}[{i}]")
        if block.get("type") != "text":
            raise InvalidParam(f"{param}[{i}].type", f"unsupported block {block.get('type')!r}")
        texts.append(get_str(block, "text", f"{param}[{i}].text", required=True) or "")
    return "".join(texts)


def _parse_message(raw: Any, i: int) -> list[Message]:
    param = f"messages[{i}]"
    raw = need_object(raw, param)
    role = get_str(raw, "role", f"{param}.role", required=True)
    if role not in ("user", "assistant"):
        raise InvalidParam(f"{param}.role", "expected 'user' or 'assistant'")
    content = raw.get("content")
    if isinstance(content, str):
        return [Message(role, content)]  # type: ignore[arg-type]
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[ToolCall] = []
    results: list[Message] = []
    for j, block in enumerate(get_list(raw, "content", f"{param}.content", required=True) or ()):
        where = f"{param}.content[{j}]"
        block = need_object(block, where)
        kind = block.get("type")
        if kind == "text":
            texts.append(get_str(block, "text", f"{where}.text", required=True) or "")
        elif kind == "tool_use" and role == "assistant":
            try:
                arguments = orjson.dumps(get_object(block, "input", f"{where}.input")
                                         or {}).decode()
            except orjson.JSONEncodeError:  # orjson writes 254 levels; the body is read up to 1024
                raise InvalidParam(f"{where}.input", "is nested too deeply (more than ~250 "
                                   "levels)") from None
            calls.append(ToolCall(get_str(block, "id", f"{where}.id", required=True) or "",
                                  get_tool_name(block, "name", f"{where}.name"), arguments))
        elif kind == "tool_result" and role == "user":
            text = _text_of(block.get("content") or "", f"{where}.content")
            if get_bool(block, "is_error", f"{where}.is_error"):
                text = f"Error: {text}"
            results.append(Message("tool", text, tool_call_id=get_str(
                block, "tool_use_id", f"{where}.tool_use_id", required=True)))
        elif kind == "thinking" and role == "assistant":
            thinking.append(get_str(block, "thinking", f"{where}.thinking") or "")
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise InvalidParam(f"{where}.type", f"unsupported block {kind!r} in a {role} message")
    cache_control = _cache_control_of(content)
    if role == "assistant":
        return [Message("assistant", "".join(texts), tuple(calls), reasoning="".join(thinking),
                        cache_control=cache_control)]
    if results and not texts and cache_control is not None:  # on the last tool result
        results[-1] = replace(results[-1], cache_control=cache_control)
    return results + ([Message("user", "".join(texts), cache_control=cache_control)]
                      if texts or not results else [])


def _cache_control_of(content: Any) -> str | None:
    """The last cache_control object among a message's (or system's) blocks, as JSON text:
    a native Anthropic upstream gets it back on the message's block."""
    if not isinstance(content, list):
        return None
    for block in reversed(content):
        if isinstance(block, dict) and isinstance(block.get("cache_control"), dict):
            return orjson.dumps(block["cache_control"]).decode()
    return None


CACHE_TTL_S = {"5m": 300.0, "1h": 3600.0}  # cache_control ttl values (absent: "5m")


def _cache_retention_s(body: dict[str, Any]) -> float | None:
    """The longest `cache_control` ttl in seconds anywhere Anthropic takes one (the top level,
    system blocks, tools, message blocks); None when none is set. Each must be
    `{"type": "ephemeral", "ttl"?: "5m" | "1h"}`."""
    found: list[tuple[Any, str]] = [(body.get("cache_control"), "cache_control")]
    system = body.get("system")
    if isinstance(system, list):
        found += [(b.get("cache_control"), f"system[{i}].cache_control")
                  for i, b in enumerate(system) if isinstance(b, dict)]
    tools = body.get("tools")
    if isinstance(tools, list):
        found += [(t.get("cache_control"), f"tools[{i}].cache_control")
                  for i, t in enumerate(tools) if isinstance(t, dict)]
    for i, message in enumerate(body.get("messages") or ()):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            found += [(b.get("cache_control"), f"messages[{i}].content[{j}].cache_control")
                      for j, b in enumerate(content) if isinstance(b, dict)]
    longest: float | None = None
    for value, where in found:
        if value is None:
            continue
        control = need_object(value, where)
        if control.get("type") != "ephemeral":
            raise InvalidParam(f"{where}.type", "expected 'ephemeral'")
        ttl = control.get("ttl", "5m")
        if ttl not in CACHE_TTL_S:
            raise InvalidParam(f"{where}.ttl", "expected '5m' or '1h'")
        longest = max(longest or 0.0, CACHE_TTL_S[ttl])
    return longest


def _parse_tool_choice(value: Any) -> str | dict[str, Any] | None:
    if value is None:
        return None
    choice = need_object(value, "tool_choice")
    kind = get_str(choice, "type", "tool_choice.type", required=True)
    if kind == "tool":
        name = get_str(choice, "name", "tool_choice.name", required=True)
        return {"type": "function", "function": {"name": name}}
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind or "")
    if mapped is None:
        raise InvalidParam("tool_choice.type", "expected 'auto', 'any', 'tool' or 'none'")
    return mapped


def _parse_output_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """Structured output: `output_config.format` (or the beta's top-level `output_format`),
    `{"type": "json_schema", "schema": {...}}`, in OpenAI chat's `response_format` form."""
    config = get_object(body, "output_config")
    param = "output_config.format"
    spec = get_object(config, "format", param) if config is not None else None
    if spec is None:
        param = "output_format"
        spec = get_object(body, param)
    if spec is None:
        return None
    if spec.get("type") != "json_schema":
        raise InvalidParam(f"{param}.type", "expected 'json_schema'")
    schema = get_object(spec, "schema", f"{param}.schema")
    if schema is None:
        raise InvalidParam(f"{param}.schema", "is required")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


def _parse_thinking(body: dict[str, Any], request: CanonicalRequest) -> None:
    """`thinking` onto the upstream's switches: disabled -> the chat template's enable_thinking
    false (Qwen3); enabled -> enable_thinking true and a reasoning_effort from budget_tokens
    (gpt-oss: under 2,048 low, under 8,192 medium, else high)."""
    thinking = get_object(body, "thinking")
    if thinking is None:
        return
    kind = get_str(thinking, "type", "thinking.type", required=True)
    if kind == "disabled":
        request.chat_template_kwargs = {"enable_thinking": False}
    elif kind in ("enabled", "adaptive"):
        request.chat_template_kwargs = {"enable_thinking": True}
        budget = get_int(thinking, "budget_tokens", "thinking.budget_tokens", minimum=1,
                         required=kind == "enabled")
        if budget is not None:
            request.reasoning_effort = ("low" if budget < 2048 else
                                        "medium" if budget < 8192 else "high")
    else:
        raise InvalidParam("thinking.type", "expected 'enabled', 'adaptive' or 'disabled'")


def thinking_signature(thinking: str) -> str:
    """A thinking block's `signature`: opaque to clients, which send it back with the block (a
    digest of the text; it vouches for nothing, there being no Anthropic key behind it)."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


def _usage(usage: Usage | None) -> dict[str, Any]:
    usage = usage or Usage(0, 0)
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": usage.cached_tokens,
            "output_tokens": usage.completion_tokens}


class AnthropicMessages(Dialect):
    name = "anthropic"

    def parse(self, body: Any, request_id: str) -> CanonicalRequest:
        body = need_object(body, "body")
        request = CanonicalRequest(request_id, get_str(body, "model", required=True,
                                                       allow_empty=False) or "")
        request.max_tokens = get_int(body, "max_tokens", required=True, minimum=1)
        _check_thread(body.get("thread"))
        system = body.get("system")
        if system is not None:
            request.messages.append(Message("system", _text_of(system, "system"),
                                            cache_control=_cache_control_of(system)))
        results = ToolResults()  # each tool_result answers a tool_use of the message before
        messages = get_list(body, "messages", required=True, non_empty=True) or []
        for i, raw in enumerate(messages):
            if (isinstance(raw, dict) and raw.get("content") in ("", [])
                    and not (i == len(messages) - 1 and raw.get("role") == "assistant")):
                raise InvalidParam(f"messages[{i}].content", "all messages must have non-empty "
                                   "content except for the optional final assistant message")
            for message in _parse_message(raw, i):
                results.add(message, f"messages[{i}].content")
                request.messages.append(message)
        last = request.messages[-1]
        request.continue_final_message = (last.role == "assistant" and not last.tool_calls
                                          and bool(last.content.strip()))
        for i, raw in enumerate(get_list(body, "tools") or ()):
            raw = need_object(raw, f"tools[{i}]")
            request.tools.append(Tool(
                get_tool_name(raw, "name", f"tools[{i}].name"),
                get_str(raw, "description", f"tools[{i}].description") or "",
                get_tool_schema(raw, "input_schema", f"tools[{i}].input_schema")))
        request.tool_choice = _parse_tool_choice(body.get("tool_choice"))
        if request.tool_choice is not None and get_bool(
                body["tool_choice"], "disable_parallel_tool_use",
                "tool_choice.disable_parallel_tool_use"):
            request.parallel_tool_calls = False  # at most one call
        request.temperature = get_number(body, "temperature", minimum=0.0, maximum=1.0)
        request.top_p = get_number(body, "top_p", minimum=0.0, maximum=1.0)
        request.top_k = get_int(body, "top_k", minimum=1)
        metadata = get_object(body, "metadata")
        if metadata is not None:
            request.user = get_str(metadata, "user_id", "metadata.user_id")
        if isinstance(body.get("stop_sequences"), str):  # (OpenAI's `stop` may be one string)
            raise InvalidParam("stop_sequences", "expected an array of strings")
        request.stop = get_stop(body, "stop_sequences", max_items=16)
        request.stream = bool(get_bool(body, "stream"))
        request.response_format = _parse_output_format(body)
        if request.response_format is not None and request.continue_final_message:
            # the grammar would start the JSON again after the prefilled text
            raise InvalidParam("messages", "a last assistant message (prefill) cannot be "
                               "combined with output_config.format")
        _parse_thinking(body, request)
        request.cache_retention_s = _cache_retention_s(body)
        tier = body.get("service_tier")  # "standard_only": the default class; "auto": the project's
        if tier is not None and tier not in ("auto", "standard_only"):
            raise InvalidParam("service_tier", "must be 'auto' or 'standard_only'")
        request.service_tier = "default" if tier == "standard_only" else None
        check_sampling(request, {"stop": "stop_sequences"})
        return request

    def parse_count_tokens(self, body: Any, request_id: str) -> CanonicalRequest:
        """A `POST /v1/messages/count_tokens` body: a Messages body without `max_tokens`."""
        return self.parse({**need_object(body, "body"), "max_tokens": 1, "stream": False},
                          request_id)

    def render(self, request: CanonicalRequest, response: CanonicalResponse) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if response.reasoning:
            content.append({"type": "thinking", "thinking": response.reasoning,
                            "signature": thinking_signature(response.reasoning)})
        if response.text:
            content.append({"type": "text", "text": response.text})
        content += [{"type": "tool_use", "id": c.id, "name": c.name,
                     "input": _json_input(c.arguments)}
                    for c in response.tool_calls]
        return {"id": f"msg_{request.request_id}", "type": "message", "role": "assistant",
                "model": request.model, "content": content,
                "stop_reason": _stop_reason(response), "stop_sequence": response.stop_sequence,
                "usage": _usage(response.usage)}

    def encoder(self, request: CanonicalRequest) -> StreamEncoder:
        return _MessagesEncoder(request)

    def error_body(self, status: int, code: str, message: str, param: str | None = None,
                   error_type: str | None = None) -> dict[str, Any]:
        return error_body(status, code, message)  # Anthropic errors have no param


def _json_input(arguments: str) -> Any:
    try:
        value = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return {"_raw": arguments}
    return value if isinstance(value, dict) else {"value": value}


def _sse(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class _MessagesEncoder(StreamEncoder):
    def __init__(self, request: CanonicalRequest) -> None:
        self._request = request
        self._num_blocks = 0
        self._open: str | None = None  # "text" | "thinking" | "tool_use"
        self._thinking: list[str] = []  # the open thinking block's text (for its signature)
        self._call_index: int | None = None  # the ToolCallDelta index of the last tool_use block
        self._text_head = (b'event: content_block_delta\ndata: '
                           b'{"type":"content_block_delta","index":')

    def start(self, prompt: PromptUsage | None = None) -> bytes:
        """`message_start` carries the input tokens when the upstream announced them (as
        Anthropic's does: clients such as LangChain read them here), else zeros."""
        usage = Usage(prompt.prompt_tokens, 0, prompt.cached_tokens) if prompt is not None else None
        return _sse("message_start", {"type": "message_start", "message": {
            "id": f"msg_{self._request.request_id}", "type": "message", "role": "assistant",
            "model": self._request.model, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": _usage(usage)}})

    def _close_block(self) -> bytes:
        if self._open is None:
            return b""
        out = b""
        if self._open == "thinking":  # Anthropic sends the signature last, before the stop
            signature = thinking_signature("".join(self._thinking))
            self._thinking = []
            out = _sse("content_block_delta", {
                "type": "content_block_delta", "index": self._num_blocks,
                "delta": {"type": "signature_delta", "signature": signature}})
        self._open = None
        self._num_blocks += 1
        return out + _sse("content_block_stop", {"type": "content_block_stop",
                                                 "index": self._num_blocks - 1})

    def event(self, event: CanonicalEvent) -> bytes:
        out = b""
        if isinstance(event, ReasoningDelta):
            if self._open != "thinking":
                out += self._close_block()
                self._open = "thinking"
                out += _sse("content_block_start", {
                    "type": "content_block_start", "index": self._num_blocks,
                    "content_block": {"type": "thinking", "thinking": "", "signature": ""}})
            self._thinking.append(event.text)
            return out + _sse("content_block_delta", {
                "type": "content_block_delta", "index": self._num_blocks,
                "delta": {"type": "thinking_delta", "thinking": event.text}})
        if isinstance(event, TextDelta):
            if self._open != "text":
                out += self._close_block()
                self._open = "text"
                out += _sse("content_block_start", {"type": "content_block_start",
                                                    "index": self._num_blocks,
                                                    "content_block": {"type": "text", "text": ""}})
            return out + (self._text_head + str(self._num_blocks).encode()
                          + b',"delta":{"type":"text_delta","text":' + orjson.dumps(event.text)
                          + b"}}\n\n")
        if isinstance(event, ToolCallDelta):
            # a new call: a piece with an id, or of another index (an upstream may send no ids)
            if event.id or self._open != "tool_use" or event.index != self._call_index:
                out += self._close_block()
                self._open = "tool_use"
                self._call_index = event.index
                out += _sse("content_block_start", {
                    "type": "content_block_start", "index": self._num_blocks,
                    "content_block": {"type": "tool_use", "id": event.id or f"toolu_{event.index}",
                                      "name": event.name or "", "input": {}}})
            if event.arguments:
                out += _sse("content_block_delta", {
                    "type": "content_block_delta", "index": self._num_blocks,
                    "delta": {"type": "input_json_delta", "partial_json": event.arguments}})
        return out

    def finish(self, response: CanonicalResponse) -> bytes:
        delta = {"stop_reason": _stop_reason(response), "stop_sequence": response.stop_sequence}
        return (self._close_block()
                + _sse("message_delta", {"type": "message_delta", "delta": delta,
                                         "usage": _usage(response.usage)})
                + _sse("message_stop", {"type": "message_stop"}))

    def error(self, status: int, code: str, message: str) -> bytes:
        return _sse("error", error_body(status, code, message))
