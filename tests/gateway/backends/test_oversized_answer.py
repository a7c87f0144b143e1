"""A non-streamed upstream answer is read whole, but only up to `max_upstream_answer_bytes`:
past it the client gets the dialect's 502 and the request is billed as admitted, once."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from gateway.request.canonical import CanonicalRequest, Message, estimate_prompt_tokens
from gateway.upstream.transport import ERROR_BODY_MAX_BYTES
from tests.gateway.conftest import (
    MODEL,
    GatewayFactory,
    LoopThread,
    start_app,
    start_chat_upstream,
    wait_until,
)

MAX_BYTES = 64 * 1024


def _answer(text: str) -> dict[str, Any]:
    return {"id": "c1", "object": "chat.completion", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "stop"}]}


def _upstream(loop_thread: LoopThread) -> tuple[web.AppRunner, str, list[str]]:
    """Answers by the prompt: "big" a JSON body of 4 x MAX_BYTES with its content-length,
    "chunked" the same body chunked (no length announced: counted as it comes), "huge_error" a
    400 with a body of 2 MiB, else a small answer. `served` lists the prompts answered."""
    served: list[str] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        prompt = (await request.json())["messages"][-1]["content"]
        served.append(prompt)
        if prompt == "small":
            return web.json_response({**_answer("fine"), "usage": {
                "prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})
        if prompt == "huge_error":  # past ERROR_BODY_MAX_BYTES
            return web.Response(status=400, body=b"e" * (2 * ERROR_BODY_MAX_BYTES))
        body = orjson.dumps(_answer("x" * (4 * MAX_BYTES)))
        if prompt == "big":
            return web.Response(body=body, content_type="application/json")
        response = web.StreamResponse(headers={"content-type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        try:
            for start in range(0, len(body), 8192):
                await response.write(body[start:start + 8192])
        except ConnectionError:  # the gateway dropped the connection past its bound
            pass
        return response

    runner, url = start_chat_upstream(loop_thread, chat)
    return runner, url, served


@pytest.mark.parametrize("prompt", ["big", "chunked"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_an_answer_over_the_bound_is_a_502_billed_as_admitted(
        prompt: str, path: str, make_gateway: GatewayFactory, loop_thread: LoopThread) -> None:
    runner, url, served = _upstream(loop_thread)
    try:
        gateway = make_gateway(num_upstreams=0, configs=[], max_upstream_answer_bytes=MAX_BYTES,
                               models=[{"name": MODEL, "backend": "openai",
                                        "endpoints": [url, url + "/"],
                                        "prices": {"output_per_token": 1e-6}}])
        body = {"model": MODEL, "max_tokens": 50,
                "messages": [{"role": "user", "content": prompt}]}
        response = httpx.post(gateway.url + path, json=body, timeout=30)
        assert response.status_code == 502
        error = response.json()["error"]
        assert "max_upstream_answer_bytes" in error["message"]
        if path == "/v1/messages":  # the Anthropic envelope
            assert response.json()["type"] == "error" and error["type"] == "api_error"
        else:
            assert error["code"] == "upstream_unavailable"
        assert served == [prompt]  # no retry on the other endpoint: it would compute it again
        request_id = response.headers["x-request-id"]
        assert wait_until(lambda: request_id in gateway.meter.settled)
        record = gateway.meter.settled[request_id]
        assert (record.status, record.finish_reason) == (502, "error")
        assert record.completion_tokens == 50  # what admission reserved for the one choice
        if path == "/v1/chat/completions":
            assert record.prompt_tokens == estimate_prompt_tokens(CanonicalRequest(
                "r", MODEL, messages=[Message("user", prompt)]))
        assert record.cost_usd > 0
        time.sleep(0.1)
        assert gateway.meter.num_settle_calls == 1
        # the bound is per answer: the next small one is read (on a fresh connection)
        small = httpx.post(gateway.url + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "small"}]})
        assert small.status_code == 200 and small.json()["choices"][0]["message"]["content"] \
            == "fine"
    finally:
        loop_thread.run(runner.cleanup())


def test_an_answer_at_the_bound_is_read(make_gateway: GatewayFactory,
                                        loop_thread: LoopThread) -> None:
    runner, url, _ = _upstream(loop_thread)
    try:
        big = len(orjson.dumps(_answer("x" * (4 * MAX_BYTES))))
        gateway = make_gateway(num_upstreams=0, configs=[], max_upstream_answer_bytes=big,
                               models=[{"name": MODEL, "backend": "openai", "endpoints": [url]}])
        for prompt in ("big", "chunked"):
            response = httpx.post(gateway.url + "/v1/chat/completions", timeout=30, json={
                "model": MODEL, "messages": [{"role": "user", "content": prompt}]})
            assert response.status_code == 200, response.text
            assert len(response.json()["choices"][0]["message"]["content"]) == 4 * MAX_BYTES
    finally:
        loop_thread.run(runner.cleanup())


def test_an_anthropic_upstreams_answer_over_the_bound_is_a_502_billed_as_admitted(
        make_gateway: GatewayFactory, loop_thread: LoopThread) -> None:
    """The native anthropic backend reads its whole answers under the same bound."""

    async def messages(request: web.Request) -> web.Response:
        return web.json_response({
            "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test",
            "content": [{"type": "text", "text": "x" * (4 * MAX_BYTES)}],
            "stop_reason": "end_turn", "usage": {"input_tokens": 3, "output_tokens": 1}})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "claude-test", "type": "model"}]})

    app = web.Application()
    app.router.add_post("/v1/messages", messages)
    app.router.add_get("/v1/models", models)
    runner, url = loop_thread.run(start_app(app))
    try:
        gateway = make_gateway(num_upstreams=0, configs=[], max_upstream_answer_bytes=MAX_BYTES,
                               models=[{"name": MODEL, "backend": "anthropic", "endpoints": [url],
                                        "api_key": "sk-ant-upstream"}])
        response = httpx.post(gateway.url + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "max_tokens": 40, "messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 502
        assert "max_upstream_answer_bytes" in response.json()["error"]["message"]
        request_id = response.headers["x-request-id"]
        assert wait_until(lambda: request_id in gateway.meter.settled)
        record = gateway.meter.settled[request_id]
        assert (record.completion_tokens, record.finish_reason) == (40, "error")
        assert gateway.meter.num_settle_calls == 1
    finally:
        loop_thread.run(runner.cleanup())


def test_an_error_answer_with_a_huge_body_is_refused_by_its_status_alone(
        make_gateway: GatewayFactory, loop_thread: LoopThread) -> None:
    """An upstream's 4xx body is read for its message, up to ERROR_BODY_MAX_BYTES: past it the
    status alone answers (the body was buffered whole before), and nothing is billed."""
    runner, url, _ = _upstream(loop_thread)
    try:
        gateway = make_gateway(num_upstreams=0, configs=[],
                               models=[{"name": MODEL, "backend": "openai", "endpoints": [url]}])
        response = httpx.post(gateway.url + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "huge_error"}]})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["message"].startswith("upstream answered 400") and "eee" not in response.text
        request_id = response.headers["x-request-id"]
        assert wait_until(lambda: request_id in gateway.meter.settled)
        assert gateway.meter.settled[request_id].completion_tokens == 0
    finally:
        loop_thread.run(runner.cleanup())


def test_a_stream_line_without_end_past_the_bound_cuts_the_stream(
        make_gateway: GatewayFactory, loop_thread: LoopThread,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A streamed line is buffered until its newline: one that never ends (here past a bound of
    4 KiB, 64 MiB by default) fails the stream as a cut one, billed for what was sent."""
    from gateway.upstream import lean_transport

    monkeypatch.setattr(lean_transport, "STREAM_LINE_MAX_BYTES", 4096)

    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        chunk = {"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": None}]}
        await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await asyncio.sleep(0.05)
        try:
            for _ in range(8):
                await response.write(b"x" * 1024)  # no newline, ever
                await asyncio.sleep(0.01)
            await asyncio.sleep(5)
        except ConnectionError:
            pass
        return response

    runner, url = start_chat_upstream(loop_thread, chat)
    try:
        gateway = make_gateway(num_upstreams=0, configs=[],
                               models=[{"name": MODEL, "backend": "openai", "endpoints": [url]}])
        started = time.monotonic()
        response = httpx.post(gateway.url + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]})
        assert time.monotonic() - started < 4  # not at the upstream's end
        assert '"ok"' in response.text and "a stream line is over 4096 bytes" in response.text
        request_id = response.headers["x-request-id"]
        assert wait_until(lambda: request_id in gateway.meter.settled)
        record = gateway.meter.settled[request_id]
        assert (record.finish_reason, record.completion_tokens) == ("error", 1)
        assert gateway.meter.num_settle_calls == 1
    finally:
        loop_thread.run(runner.cleanup())
