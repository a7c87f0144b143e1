"""Text completion responses from a started FanOut (choice index = prompt * n + sample).

Streams send `text_completion` chunks with the new text as it comes, an empty-text chunk with
finish_reason, a usage chunk (choices: []) when stream_options.include_usage, then [DONE]; on an
engine failure mid-stream an error event is sent and the stream closes without [DONE].
"""

from __future__ import annotations

import logging

from aiohttp import web

from engine.server import responses as shapes
from engine.server.choices import ChoiceState, usage_of
from engine.server.errors import json_response
from engine.server.fanout import FanOut
from engine.server.protocol import CompletionRequest
from engine.server.serving import ServingContext
from engine.server.sse import ClientGone, EventStream
from engine.server.token_bytes import token_bytes_of

log = logging.getLogger(__name__)


async def complete_text(ctx: ServingContext, req: CompletionRequest, fanout: FanOut,
                        num_choices: int, id_: str, created: int) -> web.Response:
    states = [ChoiceState() for _ in range(num_choices)]
    async for index, output in fanout:
        states[index].add(output)
    choices = [
        shapes.completion_choice(
            index, state.text,
            shapes.completion_logprobs(state.logprobs, token_bytes_of(ctx.engine.tokenizer))
            if req.logprobs is not None else None,
            state.finish_reason, state.stop_reason)
        for index, state in enumerate(states)
    ]
    body = shapes.completion(id_, created, req.model, choices, usage_of(states, req.n))
    return json_response(body)


async def stream_text(request: web.Request, ctx: ServingContext, req: CompletionRequest,
                      fanout: FanOut, num_choices: int, id_: str, created: int
                      ) -> web.StreamResponse:
    stream = EventStream(request)
    await stream.open()
    states = [ChoiceState() for _ in range(num_choices)]

    async def chunk(choices: list[dict[str, object]], usage_: dict[str, object] | None = None
                    ) -> None:
        body = shapes.completion(id_, created, req.model, choices, usage_)
        if req.include_usage_chunk and usage_ is None:
            body["usage"] = None
        await stream.send(body)

    try:
        try:
            async for index, output in fanout:
                state = states[index]
                offset = len(state.text)
                state.add(output)
                if output.text or (req.logprobs is not None and output.logprobs):
                    logprobs = None
                    if req.logprobs is not None:
                        logprobs = shapes.completion_logprobs(
                            output.logprobs or [], token_bytes_of(ctx.engine.tokenizer), offset)
                    await chunk([shapes.completion_choice(index, output.text, logprobs, None)])
                if output.finished:
                    await chunk([shapes.completion_choice(index, "", None, state.finish_reason,
                                                          state.stop_reason)])
        except ClientGone:
            raise
        except Exception:
            log.exception("engine failed mid-stream (request %s)", id_)
            await stream.send_error("The engine failed while generating this response.")
            return stream.response
        if req.include_usage_chunk:
            await chunk([], usage_of(states, req.n))
        await stream.send_done()
    except ClientGone:
        log.info("client went away mid-stream (request %s); aborting", id_)
    return stream.response
