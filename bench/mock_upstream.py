"""A fast mock OpenAI-compatible upstream, for the gateway's tests and benchmark (nowhere else).

Speaks POST /v1/chat/completions and /v1/completions (JSON or SSE with include_usage and
prompt_tokens_details.cached_tokens), GET /v1/models (with max_model_len), /health and /metrics
(replica-style gauges). Behaviour is set by a `MockConfig` that tests may change at any time:
latency before the first byte, number of tokens and delay between them, and a failure mode:

    "before_first_byte"  answer 500 without streaming anything
    "mid_stream"         stream `fail_after_tokens` tokens, then drop the connection
    "hang"               accept the request and never answer
    "throttle"           answer 429 with Retry-After and x-ratelimit-* headers (OpenAI's error body)
With `enforce_context`, a prompt (~4 characters a token) plus max_tokens over `max_model_len` is
refused as vLLM refuses it (400, "This model's maximum context length is ...").
Requests that ask for tools get one tool call to the first tool unless the last message is a tool
result. `MockState` records request ids, bodies and which requests the client abandoned.

    python -m bench.mock_upstream --port 9001 --num-tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from aiohttp import web

FailMode = Literal["none", "before_first_byte", "mid_stream", "hang", "throttle"]
THROTTLE_HEADERS = {"retry-after": "7", "x-ratelimit-limit-requests": "60",
                    "x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "7s"}


@dataclass
class MockConfig:
    model: str = "mock-model"
    max_model_len: int = 4096
    latency_ms: float = 0.0  # before the first byte
    token_delay_ms: float = 0.0  # between two streamed tokens
    num_tokens: int = 8
    num_cached_tokens: int = 0
    fail_mode: FailMode = "none"
    fail_after_tokens: int = 2
    health_status: int = 200
    send_usage: bool = True
    enforce_context: bool = False


@dataclass
class MockState:
    config: MockConfig = field(default_factory=MockConfig)
    request_ids: list[str] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    disconnected_ids: list[str] = field(default_factory=list)
    num_running: int = 0
    is_recording: bool = True  # keep request ids and bodies (tests read them; the benchmark's
    # standalone mock does not: a run's ~100k kept bodies made its GC pauses grow through the run)


STATE = web.AppKey("mock_state", MockState)


def _num_prompt_tokens(body: dict[str, Any]) -> int:
    text = (body.get("prompt")
            or "".join(str(m.get("content") or "") for m in body.get("messages") or ()))
    return max(1, len(str(text)) // 4)


def _wants_tool_call(body: dict[str, Any]) -> bool:
    messages = body.get("messages") or []
    return bool(body.get("tools")) and not (messages and messages[-1].get("role") == "tool")


def _plan(body: dict[str, Any], config: MockConfig) -> tuple[int, str]:
    max_tokens = body.get("max_tokens")
    num_tokens = config.num_tokens
    if isinstance(max_tokens, int) and max_tokens < num_tokens:
        return max_tokens, "length"
    return num_tokens, "tool_calls" if _wants_tool_call(body) else "stop"


def _usage(body: dict[str, Any], num_tokens: int, config: MockConfig) -> dict[str, Any]:
    num_prompt = _num_prompt_tokens(body) + config.num_cached_tokens
    return {"prompt_tokens": num_prompt, "completion_tokens": num_tokens,
            "total_tokens": num_prompt + num_tokens,
            "prompt_tokens_details": {"cached_tokens": config.num_cached_tokens}}


def _tool_call(body: dict[str, Any]) -> dict[str, Any]:
    name = body["tools"][0]["function"]["name"]
    return {"index": 0, "id": "call_mock0", "type": "function",
            "function": {"name": name, "arguments": '{"city": "Paris"}'}}


async def _completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    config = state.config
    body = await request.json(loads=orjson.loads)
    request_id = request.headers.get("x-request-id", "")
    if state.is_recording:
        state.request_ids.append(request_id)
        state.bodies.append(body)
    is_chat = request.path.endswith("/chat/completions")
    state.num_running += 1
    try:
        if config.fail_mode == "hang":
            await asyncio.sleep(3600)
        if config.latency_ms:
            await asyncio.sleep(config.latency_ms / 1000)
        if config.fail_mode == "before_first_byte":
            return web.json_response({"error": {"message": "injected failure"}}, status=500)
        if config.fail_mode == "throttle":
            return web.json_response({"error": {"message": "Rate limit reached for requests",
                                                "type": "requests", "code": "rate_limit_exceeded"}},
                                     status=429, headers=THROTTLE_HEADERS)
        num_asked = _num_prompt_tokens(body) + int(body.get("max_tokens") or 0)
        if config.enforce_context and num_asked > config.max_model_len:
            return web.json_response({"error": {
                "message": f"This model's maximum context length is {config.max_model_len} "
                           f"tokens. However, you requested {num_asked} tokens.",
                "type": "BadRequestError", "param": None, "code": 400}}, status=400)
        if body.get("stream"):
            return await _stream(request, body, is_chat, config)
        num_tokens, finish = _plan(body, config)
        text = "tok " * num_tokens
        if is_chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if finish == "tool_calls":
                call = _tool_call(body)
                call.pop("index")
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
            choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish}
        answer = {"id": "mock", "object": "chat.completion" if is_chat else "text_completion",
                  "model": body.get("model"), "choices": [choice]}
        if config.send_usage:
            answer["usage"] = _usage(body, num_tokens, config)
        return web.Response(body=orjson.dumps(answer), content_type="application/json")
    except (asyncio.CancelledError, ConnectionResetError):
        state.disconnected_ids.append(request_id)
        raise
    finally:
        state.num_running -= 1


async def _stream(request: web.Request, body: dict[str, Any], is_chat: bool,
                  config: MockConfig) -> web.StreamResponse:
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    num_tokens, finish = _plan(body, config)
    head = b'data: {"id":"mock","object":"chunk","model":"m","choices":[{"index":0,'
    if is_chat:
        token_chunk = head + b'"delta":{"content":"tok "},"finish_reason":null}]}\n\n'
    else:
        token_chunk = head + b'"text":"tok ","finish_reason":null}]}\n\n'
    if finish == "tool_calls":
        call = _tool_call(body)
        first = dict(call, function={"name": call["function"]["name"], "arguments": '{"city": '})
        rest = {"index": 0, "function": {"arguments": '"Paris"}'}}
        for piece in (first, rest):
            delta = {"tool_calls": [piece]}
            await response.write(b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": delta,
                                                                        "finish_reason": None}]})
                                 + b"\n\n")
    else:
        for i in range(num_tokens):
            if config.fail_mode == "mid_stream" and i == config.fail_after_tokens:
                request.transport.close()  # type: ignore[union-attr]
                return response
            await response.write(token_chunk)
            if config.token_delay_ms:
                await asyncio.sleep(config.token_delay_ms / 1000)
    delta_key = b'"delta":{}' if is_chat else b'"text":""'
    await response.write(head + delta_key + b',"finish_reason":' + orjson.dumps(finish)
                         + b"}]}\n\n")
    if config.send_usage and (body.get("stream_options") or {}).get("include_usage"):
        usage = {"choices": [], "usage": _usage(body, num_tokens, config)}
        await response.write(b"data: " + orjson.dumps(usage) + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _models(request: web.Request) -> web.Response:
    config = request.app[STATE].config
    return web.json_response({"object": "list", "data": [
        {"id": config.model, "object": "model", "owned_by": "mock",
         "max_model_len": config.max_model_len}]})


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=request.app[STATE].config.health_status, text="ok")


async def _metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.Response(text=(
        "# TYPE aigw_replica_num_requests_running gauge\n"
        f"aigw_replica_num_requests_running {state.num_running}\n"
        "aigw_replica_num_requests_waiting 0\n"
        "aigw_replica_kv_blocks_used 3\naigw_replica_kv_blocks_total 100\n"))


def create_mock_app(state: MockState | None = None) -> web.Application:
    app = web.Application()
    app[STATE] = state or MockState()
    app.router.add_post("/v1/chat/completions", _completion)
    app.router.add_post("/v1/completions", _completion)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9001)
    parser.add_argument("--num-tokens", type=int, default=8)
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--token-delay-ms", type=float, default=0.0)
    parser.add_argument("--model", default="mock-model")
    args = parser.parse_args(argv)
    config = MockConfig(model=args.model, num_tokens=args.num_tokens, latency_ms=args.latency_ms,
                        token_delay_ms=args.token_delay_ms)
    web.run_app(create_mock_app(MockState(config, is_recording=False)), host=args.host,
                port=args.port, print=None, access_log=None, handler_cancellation=True)


if __name__ == "__main__":
    main()
