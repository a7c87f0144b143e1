"""An OpenAI-wire upstream whose answers the test scripts through the prompt, for guardrail and
request log tests: the last user message `SAY:<text>` is answered with <text> (streamed in
3-character deltas), anything else with "ok". The model `guard-model` is a Llama-Guard-style
classifier: "unsafe\\nS9" when any message holds "forbidden-topic", else "safe"."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

GUARD_MODEL = "guard-model"


def answer_of(body: dict[str, Any]) -> str:
    messages = body.get("messages") or []
    if body.get("model") == GUARD_MODEL:
        unsafe = any("forbidden-topic" in str(m.get("content")) for m in messages)
        return "unsafe\nS9" if unsafe else "safe"
    last = str(messages[-1].get("content") or "") if messages else str(body.get("prompt", ""))
    return last[4:] if last.startswith("SAY:") else "ok"


def create_scripted_upstream(seen: list[dict[str, Any]]) -> web.Application:
    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        text = answer_of(body)
        num_prompt = max(1, sum(len(str(m.get("content"))) for m in body["messages"]) // 4)
        num_completion = max(1, len(text) // 4)
        usage = {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
                 "total_tokens": num_prompt + num_completion}
        base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                "model": body["model"]}
        if not body.get("stream"):
            return web.json_response({
                **base, "object": "chat.completion",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": text}}],
                "usage": usage})
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for start in range(0, len(text), 3):
            chunk = {**base, "choices": [{"index": 0, "delta": {"content": text[start:start + 3]},
                                          "finish_reason": None}]}
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            await asyncio.sleep(0)
        await response.write(b"data: " + orjson.dumps(
            {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}) + b"\n\n")
        await response.write(b"data: " + orjson.dumps({**base, "choices": [], "usage": usage})
                             + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app
