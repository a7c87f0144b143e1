"""OpenAI Chat Completions: POST /v1/chat/completions.

Reasoning models: `reasoning_effort` and vLLM's `chat_template_kwargs` go upstream; the answer's
reasoning is the message's `reasoning_content` (and streamed as `reasoning_content` deltas), as
vLLM and DeepSeek's API name it; an assistant message's `reasoning_content` goes back upstream.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from gateway.dialects import openai_common as common
from gateway.dialects.base import Dialect, StreamEncoder
from gateway.dialects.validate import (
    InvalidParam,
    ToolResults,
    get_bool,
    get_list,
    get_name,
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
)

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
          "tool": "tool"}


def parse_content(value: Any, param: str) -> str:
    """A string, null, or an array of text parts (other part types are not supported)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise InvalidParam(param, "expected a string or an array of content parts")
    texts = []
    for i, part in enumerate(value):
        part = need_object(part, f"{param}[{i}]")
        if part.get("type") not in ("text", "input_text", "output_text"):
            raise InvalidParam(f"{param}[{i}].type",
                               f"unsupported content part {part.get('type')!r}")
        texts.append(get_str(part, "text", f"{param}[{i}].text", required=True) or "")
    return "".join(texts)


def parse_tools(body: dict[str, Any]) -> list[Tool]:
    tools = []
    for i, raw in enumerate(get_list(body, "tools") or ()):
        raw = need_object(raw, f"tools[{i}]")
        if raw.get("type") != "function":
            raise InvalidParam(f"tools[{i}].type", "only 'function' tools are supported")
        function = need_object(raw.get("function"), f"tools[{i}].function")
        tools.append(Tool(get_tool_name(function, "name", f"tools[{i}].function.name"),
                          get_str(function, "description") or "",
                          get_tool_schema(function, "parameters",
                                          f"tools[{i}].function.parameters")))
    return tools


def parse_tool_choice(value: Any) -> str | dict[str, Any] | None:
    if value is None or value in ("none", "auto", "required"):
        return value  # type: ignore[no-any-return]
    function = value.get("function") if isinstance(value, dict) else None
    if isinstance(function, dict) and isinstance(function.get("name"), str):
        return {"type": "function", "function": {"name": function["name"]}}
    raise InvalidParam("tool_choice", "expected 'none', 'auto', 'required' or a function choice")


def _parse_message(raw: Any, i: int) -> Message:
    param = f"messages[{i}]"
    raw = need_object(raw, param)
    role = _ROLES.get(get_str(raw, "role", f"{param}.role", required=True) or "")
    if role is None:
        raise InvalidParam(f"{param}.role", f"unknown role {raw.get('role')!r}")
    content = parse_content(raw.get("content"), f"{param}.content")
    calls = []
    for j, call in enumerate(get_list(raw, "tool_calls", f"{param}.tool_calls") or ()):
        call = need_object(call, f"{param}.tool_calls[{j}]")
        function = need_object(call.get("function"), f"{param}.tool_calls[{j}].function")
        calls.append(ToolCall(get_str(call, "id", f"{param}.tool_calls[{j}].id", required=True)
                              or "", get_tool_name(function, "name",
                                                   f"{param}.tool_calls[{j}].function.name"),
                              get_str(function, "arguments",
                                      f"{param}.tool_calls[{j}].function.arguments") or "{}"))
    tool_call_id = get_str(raw, "tool_call_id", f"{param}.tool_call_id", required=role == "tool")
    reasoning = get_str(raw, "reasoning_content", f"{param}.reasoning_content") or ""
    return Message(role, content, tuple(calls), tool_call_id,  # type: ignore[arg-type]
                   get_name(raw, "name", f"{param}.name"), reasoning if role == "assistant" else "")


class OpenAIChat(Dialect):
    name = "openai"

    def parse(self, body: Any, request_id: str) -> CanonicalRequest:
        body = need_object(body, "body")
        request = CanonicalRequest(request_id, get_str(body, "model", required=True,
                                                       allow_empty=False) or "")
        messages = get_list(body, "messages", required=True, non_empty=True) or []
        request.messages = [_parse_message(raw, i) for i, raw in enumerate(messages)]
        results = ToolResults()
        for i, message in enumerate(request.messages):
            results.add(message, f"messages[{i}].tool_call_id")
        request.tools = parse_tools(body)
        request.tool_choice = parse_tool_choice(body.get("tool_choice"))
        request.parallel_tool_calls = get_bool(body, "parallel_tool_calls")
        common.parse_sampling(body, request,
                              max_tokens_keys=("max_tokens", "max_completion_tokens"))
        request.response_format = common.parse_output_format(body.get("response_format"),
                                                             "response_format")
        common.parse_chat_logprobs(body, request)
        request.reasoning_effort = common.parse_reasoning_effort(body.get("reasoning_effort"),
                                                                 "reasoning_effort")
        request.chat_template_kwargs = get_object(body, "chat_template_kwargs")
        return request

    def render(self, request: CanonicalRequest, response: CanonicalResponse) -> dict[str, Any]:
        return {"id": f"chatcmpl-{request.request_id}", "object": "chat.completion",
                "created": int(time.time()), "model": request.model,
                "choices": [_choice_json(index, choice)
                            for index, choice in enumerate((response, *response.others))],
                "usage": common.usage_json(response.usage),
                "service_tier": request.service_tier or "default"}

    def encoder(self, request: CanonicalRequest) -> StreamEncoder:
        return _ChatEncoder(request)

    def error_body(self, status: int, code: str, message: str, param: str | None = None,
                   error_type: str | None = None) -> dict[str, Any]:
        return common.error_body(status, code, message, param, error_type)


def _choice_json(index: int, choice: CanonicalResponse) -> dict[str, Any]:
    # null only beside tool calls (OpenAI's form); an empty answer (e.g. cut by a stop string at
    # once) is "", as OpenAI sends it, so `content.strip()` works on every text answer
    content = choice.text if choice.text.strip() or not choice.tool_calls else None
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if choice.reasoning:
        message["reasoning_content"] = choice.reasoning
    if choice.tool_calls:
        message["tool_calls"] = [_call_json(c) for c in choice.tool_calls]
    return {"index": index, "message": message, "logprobs": common.joined_logprobs(choice.logprobs),
            "finish_reason": choice.finish_reason or "stop"}


def _call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


class _ChatEncoder(StreamEncoder):
    """Chunks as OpenAI streams them: a role delta per choice first, then content, reasoning
    (`reasoning_content`, as vLLM and DeepSeek stream it) and tool-call deltas (each naming its
    choice), a finish chunk per choice, the usage chunk if asked, [DONE]."""

    def __init__(self, request: CanonicalRequest) -> None:
        self._request = request
        self._choices_head = (b'data: {"id":"chatcmpl-' + request.request_id.encode()
                              + b'","object":"chat.completion.chunk","created":'
                              + str(int(time.time())).encode() + b',"model":'
                              + orjson.dumps(request.model) + b',"service_tier":'
                              + orjson.dumps(request.service_tier or "default")
                              + b',"choices":[{"index":')
        self._heads = [self._choices_head + str(c).encode() + b',"delta":'
                       for c in range(request.n)]
        self._tail = b',"logprobs":null,"finish_reason":null}]}\n\n'

    def _head(self, choice: int) -> bytes:
        if choice < len(self._heads):
            return self._heads[choice]
        return self._choices_head + str(choice).encode() + b',"delta":'  # (an upstream's extra)

    def start(self, prompt: PromptUsage | None = None) -> bytes:
        return b"".join(head + b'{"role":"assistant","content":""}' + self._tail
                        for head in self._heads)

    def event(self, event: CanonicalEvent) -> bytes:
        if isinstance(event, TextDelta):
            content = self._head(event.choice) + b'{"content":' + orjson.dumps(event.text) + b"}"
            if event.logprobs is None:
                return content + self._tail
            return (content + b',"logprobs":' + common.logprobs_bytes(event.logprobs)
                    + b',"finish_reason":null}]}\n\n')
        if isinstance(event, ReasoningDelta):
            return (self._head(event.choice) + b'{"reasoning_content":' + orjson.dumps(event.text)
                    + b"}" + self._tail)
        assert isinstance(event, ToolCallDelta)
        call: dict[str, Any] = {"index": event.index, "function": {"arguments": event.arguments}}
        if event.id:
            call["id"] = event.id
            call["type"] = "function"
        if event.name:
            call["function"]["name"] = event.name
        return self._head(event.choice) + orjson.dumps({"tool_calls": [call]}) + self._tail

    def finish(self, response: CanonicalResponse) -> bytes:
        out = b"".join(self._head(index) + b'{},"logprobs":null,"finish_reason":'
                       + orjson.dumps(choice.finish_reason or "stop") + b"}]}\n\n"
                       for index, choice in enumerate((response, *response.others)))
        if self._request.include_usage:
            out += common.sse_data({
                "id": f"chatcmpl-{self._request.request_id}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": self._request.model,
                "service_tier": self._request.service_tier or "default", "choices": [],
                "usage": common.usage_json(response.usage)})
        return out + common.SSE_DONE

    def error(self, status: int, code: str, message: str) -> bytes:
        return common.sse_data(common.error_body(status, code, message))
