"""A native Anthropic Messages API upstream (`backend = "anthropic"`): any of our four dialects
reaches a Claude-style upstream through it.

    canonical request -> POST {endpoint}/v1/messages (x-api-key, anthropic-version: 2023-06-01)
      system messages      -> `system` (text blocks; a message's cache_control on its block)
      user / assistant     -> text blocks (cache_control passed through); assistant tool calls
                              -> `tool_use` blocks; tool results -> `tool_result` blocks in a
                              user turn (consecutive turns of one role merged, as the API wants)
      tools, tool_choice   -> `tools` (input_schema), {"type": auto|any|tool|none};
                              parallel_tool_calls false -> disable_parallel_tool_use
      max_tokens           -> required upstream: the request's, else default_max_tokens
      stop                 -> stop_sequences; user -> metadata.user_id

Answer (SSE `message_start`, `content_block_start/delta/stop`, `message_delta`, `message_stop`,
`ping`, `error`; or one JSON message): text_delta -> TextDelta, thinking_delta ->
ReasoningDelta, tool_use + input_json_delta -> ToolCallDelta, stop_reason -> Finish. Usage:
Anthropic's `input_tokens` leaves out cached ones, so our prompt_tokens = input_tokens +
cache_creation_input_tokens + cache_read_input_tokens and cached_tokens =
cache_read_input_tokens (cache writes are metered at the input price). message_start's count
is a PromptUsage, so a stream cut short is still billed its prompt.

Errors: a 429 is UpstreamThrottled (retry-after, anthropic-ratelimit-* kept); 5xx, 529
(overloaded) and 401/403 (the gateway's own key) are UpstreamUnavailable (retried elsewhere);
another 4xx is UpstreamRejected with Anthropic's message ("prompt is too long" has code
context_length_exceeded); an `error` event mid-stream is UpstreamUnavailable. Completions
(`kind == "completion"`), n > 1, logprobs and response_format are refused with a 400.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson

from gateway.backends.base import Backend
from gateway.fleet.endpoints import Endpoint
from gateway.request.canonical import (
    CanonicalEvent,
    CanonicalRequest,
    Finish,
    FinishReason,
    Message,
    PromptUsage,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
    Usage,
)
from gateway.request.errors import UpstreamRejected, UpstreamThrottled, UpstreamUnavailable
from gateway.upstream.transport import (
    PROBE_BODY_MAX_BYTES,
    UpstreamRequest,
    UpstreamResponse,
    read_error_body,
    send_observed,
)

ANTHROPIC_VERSION = "2023-06-01"
_STOP_REASONS: dict[str, FinishReason] = {
    "end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls",
    "pause_turn": "stop", "refusal": "content_filter",
}


class AnthropicBackend(Backend):
    name = "anthropic"

    def upstream_body(self, request: CanonicalRequest, endpoint: Endpoint) -> dict[str, Any]:
        _refuse_unsupported(request)
        system: list[dict[str, Any]] = []
        turns: list[dict[str, Any]] = []
        for message in request.messages:
            if message.role == "system":
                system.append(_text_block(message))
                continue
            role = "assistant" if message.role == "assistant" else "user"
            blocks = _blocks(message)
            if turns and turns[-1]["role"] == role:
                turns[-1]["content"].extend(blocks)
            else:
                turns.append({"role": role, "content": blocks})
        max_tokens = request.max_tokens or self.settings.default_max_tokens
        body: dict[str, Any] = {"model": endpoint.model.upstream_name, "messages": turns,
                                "max_tokens": max_tokens, "stream": request.stream}
        if system:
            body["system"] = system
        if request.tools:
            body["tools"] = [{"name": t.name, "description": t.description,
                              "input_schema": t.parameters or {"type": "object"}}
                             for t in request.tools]
            choice = _tool_choice(request.tool_choice)
            if request.parallel_tool_calls is False:
                choice = {**(choice or {"type": "auto"}), "disable_parallel_tool_use": True}
            if choice is not None:
                body["tool_choice"] = choice
        for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"),
                             ("top_k", "top_k")):
            value = getattr(request, ours)
            if value is not None:
                body[theirs] = min(value, 1.0) if ours == "temperature" else value
        if request.stop:
            body["stop_sequences"] = request.stop
        if request.user:
            body["metadata"] = {"user_id": request.user}
        return body

    def upstream_headers(self, endpoint: Endpoint) -> dict[str, str]:
        headers = {"content-type": "application/json", "anthropic-version": ANTHROPIC_VERSION}
        if endpoint.model.api_key:
            headers["x-api-key"] = endpoint.model.api_key
        return headers

    async def stream(self, request: CanonicalRequest,
                     endpoint: Endpoint) -> AsyncIterator[CanonicalEvent]:
        payload = orjson.dumps(self.upstream_body(request, endpoint))
        upstream = UpstreamRequest("POST", endpoint.url + "/v1/messages", payload,
                                   self.upstream_headers(endpoint), self.settings.connect_timeout_s)
        call = request.observer.on_upstream_call(upstream)  # (a traced request's CLIENT span)
        response = await send_observed(self.transport, upstream, call)
        try:
            if response.status >= 400:
                raise _error_of(response.status, response.headers,
                                await read_error_body(response))
            if request.stream:
                async for event in _stream_events(response):
                    yield event
            else:
                body = await response.read(self.settings.max_upstream_answer_bytes)
                for event in _message_events(_json(body)):
                    yield event
        except Exception as exc:
            if call is not None and response.status < 400:  # the body broke off
                call.on_failed(exc)
            raise
        finally:
            response.close()
            if call is not None:
                call.on_ended()

    async def health(self, endpoint: Endpoint) -> bool:
        try:
            response = await self.transport.send(UpstreamRequest(
                "GET", endpoint.url + "/v1/models", headers=self.upstream_headers(endpoint),
                connect_timeout_s=self.settings.health_timeout_s))
        except Exception:  # noqa: BLE001 - health must not raise
            return False
        try:
            await response.read(PROBE_BODY_MAX_BYTES)
            return response.status == 200
        except Exception:  # noqa: BLE001
            return False
        finally:
            response.close()


def _refuse_unsupported(request: CanonicalRequest) -> None:
    why = ("embeddings" if request.kind == "embedding"
           else "completions (a prompt, not messages)" if request.kind != "chat"
           else "n > 1" if request.n > 1 else "logprobs" if request.logprobs
           else "response_format" if request.response_format is not None else None)
    if why is not None:
        raise UpstreamRejected(f"this model's Anthropic upstream does not take {why}",
                               status=400, code="invalid_request")


def _text_block(message: Message) -> dict[str, Any]:
    block: dict[str, Any] = {"type": "text", "text": message.content}
    if message.cache_control is not None:
        block["cache_control"] = orjson.loads(message.cache_control)
    return block


def _blocks(message: Message) -> list[dict[str, Any]]:
    if message.role == "tool":
        result: dict[str, Any] = {"type": "tool_result", "tool_use_id": message.tool_call_id or "",
                                  "content": message.content}
        if message.cache_control is not None:
            result["cache_control"] = orjson.loads(message.cache_control)
        return [result]
    blocks = [_text_block(message)] if message.content or not message.tool_calls else []
    for call in message.tool_calls:
        try:
            arguments = orjson.loads(call.arguments or "{}")
        except orjson.JSONDecodeError:
            arguments = {}
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name,
                       "input": arguments if isinstance(arguments, dict) else {}})
    return blocks


def _tool_choice(choice: str | dict[str, Any] | None) -> dict[str, Any] | None:
    if choice is None or choice == "auto":
        return None if choice is None else {"type": "auto"}
    if choice == "required":
        return {"type": "any"}
    if choice == "none":
        return {"type": "none"}
    if isinstance(choice, dict):
        return {"type": "tool", "name": (choice.get("function") or {}).get("name", "")}
    return None


def _error_of(status: int, headers: Any,
              body: bytes) -> UpstreamThrottled | UpstreamRejected | UpstreamUnavailable:
    if status == 429:
        kept = {name.lower(): value[:256] for name, value in headers.items()
                if name.lower() in ("retry-after", "retry-after-ms")
                or name.lower().startswith(("anthropic-ratelimit-", "x-ratelimit-"))}
        return UpstreamThrottled("the model's upstream is rate limiting requests; retry later",
                                 dict(list(kept.items())[:32]))
    if status in (401, 403) or status >= 500 or status == 408:
        return UpstreamUnavailable(f"upstream failed: it answered {status}")
    try:
        error = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        error = None
    message = error.get("message") if isinstance(error, dict) else None
    if not isinstance(message, str):
        return UpstreamRejected(f"upstream answered {status}", status=status)
    code = ("context_length_exceeded" if message.startswith("prompt is too long")
            else "upstream_rejected")
    return UpstreamRejected(message, status=status, code=code)


def _json(body: bytes) -> dict[str, Any]:
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise UpstreamUnavailable("upstream sent malformed JSON") from None
    if not isinstance(value, dict):
        raise UpstreamUnavailable("upstream sent malformed JSON")
    return value


def _usage(usage: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, cached tokens) of an Anthropic usage object."""
    read = int(usage.get("cache_read_input_tokens") or 0)
    written = int(usage.get("cache_creation_input_tokens") or 0)
    return int(usage.get("input_tokens") or 0) + written + read, read


def _message_events(message: dict[str, Any]) -> list[CanonicalEvent]:
    """A whole (non-streamed) message's events."""
    try:
        events: list[CanonicalEvent] = []
        num_calls = 0
        for block in message.get("content") or ():
            kind = block.get("type")
            if kind == "text":
                events.append(TextDelta(block["text"]))
            elif kind == "thinking":
                events.append(ReasoningDelta(block.get("thinking", "")))
            elif kind == "tool_use":
                events.append(ToolCallDelta(num_calls, block["id"], block["name"],
                                            orjson.dumps(block.get("input") or {}).decode()))
                num_calls += 1
        usage = message.get("usage") or {}
        prompt, cached = _usage(usage)
        events.append(_finish(message.get("stop_reason"), message.get("stop_sequence")))
        events.append(Usage(prompt, int(usage.get("output_tokens") or 0), cached))
        return events
    except (AttributeError, KeyError, TypeError, ValueError):
        raise UpstreamUnavailable("upstream sent a malformed answer") from None


def _finish(stop_reason: Any, stop_sequence: Any) -> Finish:
    reason = _STOP_REASONS.get(stop_reason if isinstance(stop_reason, str) else "", "stop")
    return Finish(reason, stop_sequence if isinstance(stop_sequence, str) else None)


async def _stream_events(response: UpstreamResponse) -> AsyncIterator[CanonicalEvent]:
    """The SSE stream's events; UpstreamUnavailable on an `error` event, a malformed event, or
    a stream that ends before `message_stop`."""
    prompt, cached, completion = 0, 0, 0
    usage_so_far: dict[str, Any] = {}
    stop_reason: Any = None
    stop_sequence: Any = None
    tool_index: dict[int, int] = {}  # content block index -> our tool call index
    async for line in response.lines():
        if not line.startswith(b"data:"):
            continue  # `event:` lines name what the data's `type` says too; blank lines
        try:
            event = orjson.loads(line[5:])
            kind = event["type"]
            if kind == "message_start":
                usage = usage_so_far = dict(event["message"].get("usage") or {})
                prompt, cached = _usage(usage)
                completion = int(usage.get("output_tokens") or 0)
                yield PromptUsage(prompt, cached)
            elif kind == "content_block_start":
                block = event["content_block"]
                if block.get("type") == "tool_use":
                    index = tool_index[event["index"]] = len(tool_index)
                    yield ToolCallDelta(index, block["id"], block["name"])
                elif block.get("type") == "text" and block.get("text"):
                    yield TextDelta(block["text"])
            elif kind == "content_block_delta":
                delta = event["delta"]
                if delta["type"] == "text_delta":
                    yield TextDelta(delta["text"])
                elif delta["type"] == "input_json_delta":
                    yield ToolCallDelta(tool_index[event["index"]],
                                        arguments=delta["partial_json"])
                elif delta["type"] == "thinking_delta":
                    yield ReasoningDelta(delta["thinking"])
            elif kind == "message_delta":
                stop_reason = event["delta"].get("stop_reason")
                stop_sequence = event["delta"].get("stop_sequence")
                usage = event.get("usage") or {}
                completion = int(usage.get("output_tokens") or completion)
                if "input_tokens" in usage:  # (cumulative counts, in newer API versions)
                    usage_so_far.update(usage)
                    prompt, cached = _usage(usage_so_far)
            elif kind == "message_stop":
                yield _finish(stop_reason, stop_sequence)
                yield Usage(prompt, completion, cached)
                return
            elif kind == "error":
                error = event.get("error") or {}
                raise UpstreamUnavailable(
                    f"upstream error mid-stream: {error.get('type', 'error')}: "
                    f"{error.get('message', '')}")
        except (KeyError, TypeError, ValueError, AttributeError, orjson.JSONDecodeError):
            raise UpstreamUnavailable("upstream sent a malformed stream event") from None
    raise UpstreamUnavailable("upstream stream ended before message_stop")
