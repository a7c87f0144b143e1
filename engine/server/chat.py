"""Chat completion responses from a started FanOut: one JSON body, or an SSE stream.

Streams follow OpenAI: per choice a first delta {role: "assistant", content: ""}, then content
(and tool-call) deltas, then an empty delta carrying finish_reason; a usage chunk (choices: [])
when stream_options.include_usage; then `data: [DONE]`. If the engine fails mid-stream, an error
event `data: {"error": {...}}` is sent and the stream closes without [DONE].

The SSE response is prepared only after every choice's engine request has yielded once (see
FanOut.start), so errors raised before the first token are still plain HTTP errors (400/500).
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from chat.tool_parsers import ToolCall, ToolCallStream
from engine.outputs import RequestOutput
from engine.server import responses as shapes
from engine.server.choices import ChoiceState, prompt_usage_headers, usage_of
from engine.server.errors import json_response
from engine.server.fanout import FanOut
from engine.server.protocol import ChatCompletionRequest
from engine.server.serving import ServingContext
from engine.server.sse import ClientGone, EventStream
from engine.server.token_bytes import token_bytes_of

log = logging.getLogger(__name__)


def _finish_reason(state: ChoiceState, num_tool_calls: int) -> str | None:
    return "tool_calls" if num_tool_calls else state.finish_reason


def _max_tool_calls(req: ChatCompletionRequest) -> int | None:
    """`parallel_tool_calls: false`: at most one call (as OpenAI and vLLM; calls the model makes
    after the first are dropped, also with tool_choice "auto", which no grammar bounds)."""
    return 1 if req.parallel_tool_calls is False else None


async def complete_chat(ctx: ServingContext, req: ChatCompletionRequest, fanout: FanOut,
                        id_: str, created: int) -> web.Response:
    states = [ChoiceState() for _ in range(req.n)]
    async for index, output in fanout:
        states[index].add(output)
    choices = []
    for index, state in enumerate(states):
        content: str | None = state.text
        calls: tuple[Any, ...] = ()
        if req.uses_tools:
            parsed = ctx.new_tool_parser().extract(state.text, bool(req.forced_functions))
            content, calls = parsed.content, parsed.tool_calls[:_max_tool_calls(req)]
        logprobs = (shapes.chat_logprobs(state.logprobs, token_bytes_of(ctx.engine.tokenizer))
                    if req.logprobs else None)
        choices.append(shapes.chat_choice(index, shapes.chat_message(content, calls), logprobs,
                                          _finish_reason(state, len(calls)), state.stop_reason))
    body = shapes.chat_completion(id_, created, req.model, choices, usage_of(states, req.n))
    return json_response(body)


class _ChatStreamWriter:
    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest, stream: EventStream,
                 id_: str, created: int) -> None:
        self.ctx, self.req, self.stream = ctx, req, stream
        self.id, self.created = id_, created
        self.states = [ChoiceState() for _ in range(req.n)]
        self.tool_streams: list[ToolCallStream | None] = [
            ctx.new_tool_parser().stream(bool(req.forced_functions)) if req.uses_tools else None
            for _ in range(req.n)
        ]

    async def chunk(self, choices: list[dict[str, Any]],
                    usage_: dict[str, Any] | None = None) -> None:
        await self.stream.send(shapes.chat_chunk(
            self.id, self.created, self.req.model, choices,
            with_usage_field=self.req.include_usage_chunk, usage_=usage_))

    async def write_output(self, index: int, output: RequestOutput) -> None:
        self.states[index].add(output)
        content: str = output.text
        calls: tuple[ToolCall, ...] = ()
        first = 0
        tools = self.tool_streams[index]
        if tools is not None:
            delta = tools.feed(output.text)
            content, calls = delta.content, delta.tool_calls
            if output.finished:
                rest = tools.finish()
                content, calls = content + rest.content, calls + rest.tool_calls
            first = tools.num_calls - len(calls)  # the index of `calls[0]` in the choice
            limit = _max_tool_calls(self.req)
            if limit is not None:
                calls = calls[:max(limit - first, 0)]
        logprobs = None
        if self.req.logprobs and output.logprobs:
            logprobs = shapes.chat_logprobs(output.logprobs,
                                            token_bytes_of(self.ctx.engine.tokenizer))
        if content or calls or logprobs:
            delta_body: dict[str, Any] = {}
            if content or not calls:
                delta_body["content"] = content
            if calls:
                delta_body["tool_calls"] = [shapes.tool_call_json(call, first + k)
                                            for k, call in enumerate(calls)]
            await self.chunk([shapes.chat_chunk_choice(index, delta_body, logprobs)])
        if output.finished:
            num_calls = tools.num_calls if tools else 0
            reason = _finish_reason(self.states[index], num_calls)
            await self.chunk([shapes.chat_chunk_choice(index, {}, None, reason,
                                                       self.states[index].stop_reason)])


async def stream_chat(request: web.Request, ctx: ServingContext, req: ChatCompletionRequest,
                      fanout: FanOut, id_: str, created: int) -> web.StreamResponse:
    stream = EventStream(request, prompt_usage_headers(fanout, req.n))
    await stream.open()
    writer = _ChatStreamWriter(ctx, req, stream, id_, created)
    try:
        for index in range(req.n):
            await writer.chunk([shapes.chat_chunk_choice(
                index, {"role": "assistant", "content": ""})])
        try:
            async for index, output in fanout:
                await writer.write_output(index, output)
        except ClientGone:
            raise
        except Exception:
            log.exception("engine failed mid-stream (request %s)", id_)
            await stream.send_error("The engine failed while generating this response.")
            return stream.response
        if req.include_usage_chunk:
            await writer.chunk([], usage_of(writer.states, req.n))
        await stream.send_done()
    except ClientGone:
        log.info("client went away mid-stream (request %s); aborting", id_)
    return stream.response
