"""POST /v1/chat/completions, POST /v1/completions, GET /v1/models (POST /v1/embeddings: a 400).

Prompts are rendered and tokenized in a worker thread (`asyncio.to_thread`) so a long prompt
does not stall other streams; the tokenizer and chat template are thread-safe. The sampling
params too: they compile a `response_format` schema or a forced tool call's grammar (tens of
milliseconds for a large one; llguidance releases the GIL while it compiles).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from contracts.replica_errors import InvalidRequestError, json_response
from contracts.replica_prompts import check_context_length, completion_prompts
from contracts.replica_protocol import ChatCompletionRequest, CompletionRequest
from engine.server import responses as shapes
from engine.server.chat import complete_chat, stream_chat
from engine.server.completions import complete_text, echo_of, stream_text
from engine.server.keys import SERVING_KEY
from engine.server.serving import parse_body


async def chat_completions(request: web.Request) -> web.StreamResponse:
    ctx = request.app[SERVING_KEY]
    req = await parse_body(request, ChatCompletionRequest)
    ctx.check_model(req.model)
    params = await asyncio.to_thread(ctx.sampling_params, req)
    prompt = await asyncio.to_thread(ctx.render_prompt, req, params.max_tokens)
    check_context_length(len(prompt.token_ids), params.max_tokens, ctx.engine.max_model_len,
                         "messages")
    id_, created = shapes.new_id("chatcmpl"), shapes.now_s()
    async with ctx.fanout(request, id_, [prompt.token_ids], params, cache_salt=req.cache_salt,
                          param="messages", retention=req.retention(),
                          priority=req.priority_class()) as fanout:
        if req.stream:
            return await stream_chat(request, ctx, req, fanout, id_, created, prompt.text)
        return await complete_chat(ctx, req, fanout, id_, created, prompt.text)


async def completions(request: web.Request) -> web.StreamResponse:
    ctx = request.app[SERVING_KEY]
    req = await parse_body(request, CompletionRequest)
    ctx.check_model(req.model)
    params = await asyncio.to_thread(ctx.sampling_params, req)
    prompts = await asyncio.to_thread(completion_prompts, req, ctx.engine.tokenizer,
                                      ctx.engine.model_config.vocab_size,
                                      max_tokens=params.max_tokens,
                                      max_model_len=ctx.engine.max_model_len)
    for prompt in prompts:
        check_context_length(len(prompt), params.max_tokens, ctx.engine.max_model_len, "prompt")
    id_, created = shapes.new_id("cmpl"), shapes.now_s()
    num_choices = len(prompts) * params.n
    async with ctx.fanout(request, id_, prompts, params, cache_salt=req.cache_salt,
                          param="prompt", retention=req.retention(),
                          priority=req.priority_class()) as fanout:
        echo = echo_of(req, prompts, ctx.engine.tokenizer)
        if req.stream:
            return await stream_text(request, ctx, req, fanout, num_choices, id_, created, echo)
        return await complete_text(ctx, req, fanout, num_choices, id_, created, echo)


async def embeddings(request: web.Request) -> web.Response:
    """A generative model embeds nothing: 400 naming the model (an encoder replica serves this
    route: engine/server/embeddings.py)."""
    model = request.app[SERVING_KEY].engine.model_config.model_id
    raise InvalidRequestError(f"`{model}` is not an embedding model", param="model",
                              code="model_not_embedding")


async def models(request: web.Request) -> web.Response:
    ctx = request.app[SERVING_KEY]
    engine = ctx.engine
    return json_response(shapes.model_list(ctx.model_names, engine.model_config.model_id,
                                           ctx.started_at_s, engine.max_model_len,
                                           getattr(engine, "compute_info", None)))
