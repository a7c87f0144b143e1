"""Text completion responses from a started FanOut (choice index = prompt * n + sample).

Streams send `text_completion` chunks with the new text as it comes, an empty-text chunk with
finish_reason, a usage chunk (choices: []) when stream_options.include_usage, then [DONE]; on an
engine failure mid-stream an error event is sent and the stream closes without [DONE].

`echo`: each choice's text starts with its prompt (the string as given; a token-id prompt
decoded), and with `logprobs` its logprobs start with the prompt's tokens, the first one's null
(OpenAI's form; what evaluation harnesses read to score a text). A stream sends the prompt with
the choice's first token.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from contracts.replica_errors import json_response
from contracts.replica_protocol import CompletionRequest
from engine.outputs import RequestOutput
from engine.server import responses as shapes
from engine.server.choices import ChoiceState, prompt_usage_headers, usage_of
from engine.server.fanout import FanOut
from engine.server.serving import ServingContext
from engine.server.sse import ClientGone, EventStream
from engine.server.token_bytes import token_bytes_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Echo:
    """What `echo` puts before each prompt's choices: the prompt's text and its first token."""

    texts: list[str]
    first_token_ids: list[int]


def echo_of(req: CompletionRequest, prompts: Sequence[list[int]], tokenizer: Any) -> Echo | None:
    if not req.echo:
        return None
    if isinstance(req.prompt, str):
        texts = [req.prompt]
    elif isinstance(req.prompt[0], str):
        texts = list(req.prompt)  # type: ignore[arg-type]
    else:  # token ids: their text
        texts = [tokenizer.decode(ids) for ids in prompts]
    return Echo(texts, [ids[0] for ids in prompts])


def _choice_parts(ctx: ServingContext, req: CompletionRequest, echo: Echo | None, index: int,
                  output: RequestOutput | ChoiceState, offset: int, is_first: bool
                  ) -> tuple[str, dict[str, Any] | None, int]:
    """One choice's text and logprobs for `output` (a step's, or the whole state's), and the
    logprobs' text offset after it (`offset`: the one before it); the echoed prompt goes first
    when `is_first`."""
    text = output.text
    entries = list(output.logprobs or ())
    leading = None
    if echo is not None and is_first:
        prompt = index // req.n
        text = echo.texts[prompt] + text
        if req.logprobs is not None:
            entries = list(output.prompt_logprobs or ()) + entries
            leading = echo.first_token_ids[prompt]
    if req.logprobs is None:
        return text, None, offset
    logprobs, end_offset = shapes.completion_logprobs(entries, token_bytes_of(ctx.engine.tokenizer),
                                                      offset, leading)
    return text, logprobs, end_offset


async def complete_text(ctx: ServingContext, req: CompletionRequest, fanout: FanOut,
                        num_choices: int, id_: str, created: int, echo: Echo | None = None
                        ) -> web.Response:
    states = [ChoiceState() for _ in range(num_choices)]
    async for index, output in fanout:
        states[index].add(output)
    choices = []
    for index, state in enumerate(states):
        text, logprobs, _ = _choice_parts(ctx, req, echo, index, state, 0, True)
        choices.append(shapes.completion_choice(index, text, logprobs, state.finish_reason,
                                                state.stop_reason))
    body = shapes.completion(id_, created, req.model, choices, usage_of(states, req.n))
    return json_response(body)


async def stream_text(request: web.Request, ctx: ServingContext, req: CompletionRequest,
                      fanout: FanOut, num_choices: int, id_: str, created: int,
                      echo: Echo | None = None) -> web.StreamResponse:
    stream = EventStream(request, prompt_usage_headers(fanout, req.n))
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
            # each choice's logprobs text offset so far: its tokens' text, which a held-back
            # or cut stop string does not shorten (the offsets a whole answer has)
            offsets = [0] * num_choices
            async for index, output in fanout:
                state = states[index]
                is_first = not state.text_parts
                state.add(output)
                text, logprobs, offsets[index] = _choice_parts(ctx, req, echo, index, output,
                                                               offsets[index], is_first)
                if text or (logprobs is not None and logprobs["tokens"]):
                    await chunk([shapes.completion_choice(index, text, logprobs, None)])
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
