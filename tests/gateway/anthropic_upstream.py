"""A fake Anthropic Messages API upstream on 127.0.0.1, written from Anthropic's documented wire
format (the one place a fake upstream is right: no Claude runs here).

Streams follow the documented event flow: `message_start` (a Message with empty content and
the prompt's usage), per content block `content_block_start`, `content_block_delta`s
(`text_delta`, `input_json_delta`), `content_block_stop`, a `ping`, then `message_delta`
(stop_reason, cumulative output_tokens) and `message_stop`; errors as `{"type": "error",
"error": {"type", "message"}}` with the documented statuses (400, 429 with retry-after and
anthropic-ratelimit-* headers, 529 overloaded), or an `error` event mid-stream.

What it answers is chosen by the last user text: "call the tool" (with tools) -> a tool_use
block; "throttle" -> 429; "too long" -> 400 prompt is too long; "break" -> an `error` event after
the first text delta; else the text "Hello from Claude". Prompt usage: 12 input tokens, plus 100
cache-creation tokens the first time a body carries cache_control and 100 cache-read ones after.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

TEXT = ("Hello", " from Claude")
TOOL_INPUT = {"city": "Paris", "unit": "c"}


class AnthropicState:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.cache_written = False


def _last_user_text(body: dict[str, Any]) -> str:
    for message in reversed(body.get("messages") or []):
        if message["role"] == "user":
            content = message["content"]
            if isinstance(content, str):
                return content
            return " ".join(b.get("text", "") for b in content if b.get("type") == "text")
    return ""


def _usage(state: AnthropicState, body: dict[str, Any]) -> dict[str, int]:
    cached = b'"cache_control"' in orjson.dumps(body)
    usage = {"input_tokens": 12, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    if cached and state.cache_written:
        usage["cache_read_input_tokens"] = 100
    elif cached:
        usage["cache_creation_input_tokens"] = 100
        state.cache_written = True
    return usage


def _error(status: int, kind: str, message: str, **headers: str) -> web.Response:
    return web.json_response({"type": "error", "error": {"type": kind, "message": message}},
                             status=status, headers=headers)


def _sse(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


def create_anthropic_app(state: AnthropicState) -> web.Application:
    async def messages(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        state.bodies.append(body)
        state.headers.append(dict(request.headers))
        text = _last_user_text(body)
        if "throttle" in text:
            return _error(429, "rate_limit_error", "Number of requests has exceeded your rate "
                          "limit", **{"retry-after": "23",
                                      "anthropic-ratelimit-requests-remaining": "0"})
        if "too long" in text:
            return _error(400, "invalid_request_error",
                          "prompt is too long: 250000 tokens > 200000 maximum")
        usage = _usage(state, body)
        tool = body.get("tools") and "call the tool" in text
        blocks: list[dict[str, Any]] = (
            [{"type": "tool_use", "id": "toolu_01", "name": body["tools"][0]["name"],
              "input": TOOL_INPUT}] if tool else [{"type": "text", "text": "".join(TEXT)}])
        stop_reason = "tool_use" if tool else "end_turn"
        message = {"id": "msg_01", "type": "message", "role": "assistant",
                   "model": body["model"], "stop_sequence": None}
        if not body.get("stream"):
            return web.json_response({**message, "content": blocks, "stop_reason": stop_reason,
                                      "usage": {**usage, "output_tokens": 7}})
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(_sse("message_start", {"message": {
            **message, "content": [], "stop_reason": None,
            "usage": {**usage, "output_tokens": 1}}}))
        if tool:
            await response.write(_sse("content_block_start", {"index": 0, "content_block": {
                **blocks[0], "input": {}}}))
            arguments = orjson.dumps(TOOL_INPUT).decode()
            for piece in (arguments[:9], arguments[9:]):
                await response.write(_sse("content_block_delta", {"index": 0, "delta": {
                    "type": "input_json_delta", "partial_json": piece}}))
        else:
            await response.write(_sse("content_block_start", {"index": 0, "content_block": {
                "type": "text", "text": ""}}))
            await response.write(_sse("ping", {}))
            for i, piece in enumerate(TEXT):
                await response.write(_sse("content_block_delta", {"index": 0, "delta": {
                    "type": "text_delta", "text": piece}}))
                if i == 0 and "break" in text:
                    await response.write(_sse("error", {"error": {
                        "type": "overloaded_error", "message": "Overloaded"}}))
                    await response.write_eof()
                    return response
        await response.write(_sse("content_block_stop", {"index": 0}))
        await response.write(_sse("message_delta", {"delta": {
            "stop_reason": stop_reason, "stop_sequence": None}, "usage": {"output_tokens": 7}}))
        await response.write(_sse("message_stop", {}))
        await response.write_eof()
        return response

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"type": "model", "id": "claude-test"}],
                                  "has_more": False})

    app = web.Application()
    app.router.add_post("/v1/messages", messages)
    app.router.add_get("/v1/models", models)
    return app
