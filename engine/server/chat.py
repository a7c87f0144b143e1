"""Chat completion responses from a started FanOut: one JSON body, or an SSE stream.

Streams follow OpenAI: per choice a first delta {role: "assistant", content: ""}, then content
(and tool-call, and `reasoning_content`) deltas, then an empty delta carrying finish_reason; a usage
chunk (choices: []) when stream_options.include_usage; then `data: [DONE]`. If the engine fails
mid-stream, an error event `data: {"error": {...}}` is sent and the stream closes without [DONE].

Every answer goes through the checkpoint's output parser (chat/output.py, chosen by
chat/registry.py): reasoning (`<think>`, harmony's analysis channel) comes out as the message's
`reasoning_content` (vLLM's and DeepSeek's name) and counts in usage's
`completion_tokens_details.reasoning_tokens`; families without reasoning send neither field.

The SSE response is prepared only after every choice's engine request has yielded once (see
FanOut.start), so errors raised before the first token are still plain HTTP errors (400/500).
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from chat.output import OutputDelta, OutputParser
from contracts.replica_errors import json_response
from contracts.replica_protocol import ChatCompletionRequest
from engine.outputs import RequestOutput
from engine.server import responses as shapes
from engine.server.choices import ChoiceState, prompt_usage_headers, usage_of
from engine.server.fanout import FanOut
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


def _has_reasoning(ctx: ServingContext) -> bool:
    return ctx.chat_format.reasoning is not None


async def complete_chat(ctx: ServingContext, req: ChatCompletionRequest, fanout: FanOut,
                        id_: str, created: int, prompt_text: str = "") -> web.Response:
    states = [ChoiceState() for _ in range(req.n)]
    parsers = [ctx.new_output_parser(req, prompt_text) for _ in range(req.n)]
    totals = [OutputDelta() for _ in range(req.n)]
    async for index, output in fanout:
        states[index].add(output)
        totals[index] += parsers[index].feed(output.new_token_ids, output.text)
    choices = []
    for index, state in enumerate(states):
        total = totals[index] + parsers[index].finish()
        state.num_reasoning_tokens = parsers[index].num_reasoning_tokens
        content: str | None = total.content
        calls = total.tool_calls[:_max_tool_calls(req)]
        if req.uses_tools and (calls or req.forced_functions) and not total.content.strip():
            content = None  # an answer of calls (and whitespace) has no text
        reasoning = (total.reasoning or None) if _has_reasoning(ctx) else shapes.NO_REASONING
        logprobs = (shapes.chat_logprobs(state.logprobs, token_bytes_of(ctx.engine.tokenizer))
                    if req.logprobs else None)
        choices.append(shapes.chat_choice(index, shapes.chat_message(content, calls, reasoning),
                                          logprobs, _finish_reason(state, len(calls)),
                                          state.stop_reason))
    body = shapes.chat_completion(id_, created, req.model, choices,
                                  usage_of(states, req.n, _has_reasoning(ctx)))
    return json_response(body)


class _ChatStreamWriter:
    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest, stream: EventStream,
                 id_: str, created: int, prompt_text: str) -> None:
        self.ctx, self.req, self.stream = ctx, req, stream
        self.id, self.created = id_, created
        self.states = [ChoiceState() for _ in range(req.n)]
        self.parsers: list[OutputParser] = [ctx.new_output_parser(req, prompt_text)
                                            for _ in range(req.n)]

    async def chunk(self, choices: list[dict[str, Any]],
                    usage_: dict[str, Any] | None = None) -> None:
        await self.stream.send(shapes.chat_chunk(
            self.id, self.created, self.req.model, choices,
            with_usage_field=self.req.include_usage_chunk, usage_=usage_))

    async def write_output(self, index: int, output: RequestOutput) -> None:
        state, parser = self.states[index], self.parsers[index]
        state.add(output)
        delta = parser.feed(output.new_token_ids, output.text)
        if output.finished:
            delta += parser.finish()
        state.num_reasoning_tokens = parser.num_reasoning_tokens
        calls = delta.tool_calls
        first = parser.num_calls - len(calls)  # the index of `calls[0]` in the choice
        limit = _max_tool_calls(self.req)
        if limit is not None:
            calls = calls[:max(limit - first, 0)]
        logprobs = None
        if self.req.logprobs and output.logprobs:
            logprobs = shapes.chat_logprobs(output.logprobs,
                                            token_bytes_of(self.ctx.engine.tokenizer))
        if delta.content or delta.reasoning or calls or logprobs:
            delta_body: dict[str, Any] = {}
            if delta.reasoning:
                delta_body["reasoning_content"] = delta.reasoning
            if delta.content or not (calls or delta.reasoning):
                delta_body["content"] = delta.content
            if calls:
                delta_body["tool_calls"] = [shapes.tool_call_json(call, first + k)
                                            for k, call in enumerate(calls)]
            await self.chunk([shapes.chat_chunk_choice(index, delta_body, logprobs)])
        if output.finished:
            reason = _finish_reason(state, parser.num_calls)
            await self.chunk([shapes.chat_chunk_choice(index, {}, None, reason,
                                                       state.stop_reason)])


async def stream_chat(request: web.Request, ctx: ServingContext, req: ChatCompletionRequest,
                      fanout: FanOut, id_: str, created: int,
                      prompt_text: str = "") -> web.StreamResponse:
    stream = EventStream(request, prompt_usage_headers(fanout, req.n))
    await stream.open()
    writer = _ChatStreamWriter(ctx, req, stream, id_, created, prompt_text)
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
            await writer.chunk([], usage_of(writer.states, req.n, _has_reasoning(ctx)))
        await stream.send_done()
    except ClientGone:
        log.info("client went away mid-stream (request %s); aborting", id_)
    return stream.response
