"""A stream cut before its usage chunk is billed with the prompt count the upstream announced."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from auth.principal import Principal
from gateway.backends.openai_compat import _announced_prompt
from gateway.request.canonical import (
    Accumulator,
    CanonicalRequest,
    Message,
    PromptUsage,
    TextDelta,
    ToolCallDelta,
)
from gateway.request.usage import build_record
from gateway.settings import ModelSettings
from tests.gateway.conftest import (
    MODEL,
    GatewayFactory,
    LoopThread,
    start_chat_upstream,
    wait_until,
    write_sse,
)


def test_announced_prompt_is_read_from_the_replicas_headers_only_when_well_formed() -> None:
    assert _announced_prompt({"x-aigw-prompt-tokens": "38", "x-aigw-cached-tokens": "16"}) == \
        PromptUsage(38, 16)
    assert _announced_prompt({"x-aigw-prompt-tokens": "38"}) == PromptUsage(38, 0)
    assert _announced_prompt({}) is None
    assert _announced_prompt({"x-aigw-prompt-tokens": "many"}) is None


def test_a_cut_stream_bills_the_announced_prompt_and_the_text_received() -> None:
    request = CanonicalRequest("r1", "m", messages=[Message("user", "x" * 400)], stream=True)
    accumulator = Accumulator()
    accumulator.add(PromptUsage(38, 16))
    accumulator.add(TextDelta("Hello there, how are"))
    record = build_record(request, Principal(project="p", key_id="k", scopes=frozenset()),
                          ModelSettings(name="m", endpoints=("http://127.0.0.1:1",)),
                          "e", accumulator, 499, 1.0)
    assert (record.prompt_tokens, record.cached_tokens, record.completion_tokens) == (38, 16, 5)
    assert accumulator.response().text == "Hello there, how are"


def test_a_cut_stream_bills_the_completion_of_every_choice_and_its_tool_calls() -> None:
    """n > 1: the other choices' text counts too (it was choice 0's alone), and so do the tool
    calls received (a cut forced call billed no completion at all)."""
    request = CanonicalRequest("r1", "m", messages=[Message("user", "hi")], stream=True, n=2)
    accumulator = Accumulator()
    accumulator.add(PromptUsage(38, 16))
    accumulator.add(TextDelta("Hello there, how are"))  # 20 characters
    accumulator.add(TextDelta("In a world of fading", choice=1))  # 20
    accumulator.add(ToolCallDelta(0, id="call_1", name="get_weather", arguments='{"city": "Oslo"'))
    record = build_record(request, Principal(project="p", key_id="k", scopes=frozenset()),
                          ModelSettings(name="m", endpoints=("http://127.0.0.1:1",)),
                          "e", accumulator, 499, 1.0)
    assert (record.completion_tokens
            == (20 + 20 + len("get_weather") + len('{"city": "Oslo"') + 3) // 4)


def test_a_cut_echo_stream_does_not_bill_the_echoed_prompt_as_completion() -> None:
    """With echo each choice's first delta is its prompt and first token (the replica sends them
    together): one completion token, not the prompt's ~4 characters a token (capped at max_tokens,
    it billed 16 + 16 here)."""
    request = CanonicalRequest("r1", "m", kind="completion", prompt="The capital of France is",
                               echo=True, stream=True, n=2, max_tokens=16)
    accumulator = Accumulator()
    accumulator.add(PromptUsage(5, 0))
    accumulator.add(TextDelta("The capital of France is Paris"))
    accumulator.add(TextDelta("The capital of France is Lyon", choice=1))
    accumulator.add(TextDelta(". It is"))  # 7 characters: 2 tokens
    record = build_record(request, Principal(project="p", key_id="k", scopes=frozenset()),
                          ModelSettings(name="m", endpoints=("http://127.0.0.1:1",)),
                          "e", accumulator, 499, 1.0)
    assert (record.prompt_tokens, record.completion_tokens) == (5, (1 + 2) + 1)


def _announcing_upstream(loop_thread: LoopThread,
                         dies_after_headers: bool) -> tuple[web.AppRunner, str]:
    """Streams like our replica (prompt usage in the headers); one that `dies_after_headers`
    sends them and closes the connection before any chunk."""

    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream",
                                               "x-aigw-prompt-tokens": "7",
                                               "x-aigw-cached-tokens": "0"})
        await response.prepare(request)
        if dies_after_headers:
            request.transport.close()  # type: ignore[union-attr]
            return response
        await write_sse(response, (
            {"choices": [{"index": 0, "delta": {"content": "all good"}, "finish_reason": None}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
            {"choices": [],
             "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}}))
        return response

    return start_chat_upstream(loop_thread, chat)


def test_a_replica_that_dies_after_announcing_its_prompt_is_retried_on_another(
        make_gateway: GatewayFactory, loop_thread: LoopThread) -> None:
    """The headers alone are no first token: nothing was sent to the client yet, so the
    request fails over as it did before replicas announced their prompt count."""
    dead, dead_url = _announcing_upstream(loop_thread, dies_after_headers=True)
    alive, alive_url = _announcing_upstream(loop_thread, dies_after_headers=False)
    try:
        gateway = make_gateway(num_upstreams=0, configs=[], models=[
            {"name": MODEL, "backend": "replica", "endpoints": [dead_url, alive_url]}])
        for _ in range(2):
            response = httpx.post(gateway.url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True})
            assert response.status_code == 200
            assert '"all good"' in response.text and "data: [DONE]" in response.text
            assert response.headers["x-aigw-replica"] == alive_url.split("://")[1]
    finally:
        loop_thread.run(dead.cleanup())
        loop_thread.run(alive.cleanup())


def test_a_cut_stream_never_bills_more_completion_than_max_tokens_allows() -> None:
    """~4 characters a token overshoots on short tokens (digits, punctuation, spaces: a cut
    stream of max_tokens 8 was billed 10): each choice's estimate is capped at max_tokens."""
    request = CanonicalRequest("r1", "m", messages=[Message("user", "hi")], stream=True,
                               max_tokens=8, n=2)
    accumulator = Accumulator()
    accumulator.add(PromptUsage(38, 16))
    accumulator.add(TextDelta("1. 2. 3. 4. 5. 6. 7. 8. 9. 10. 11. 12. 13. 14. 15. 16. 17. 18. 19."))
    principal = Principal(project="p", key_id="k", scopes=frozenset())
    settings = ModelSettings(name="m", endpoints=("http://127.0.0.1:1",))
    record = build_record(request, principal, settings, "e", accumulator, 499, 1.0)
    assert record.completion_tokens == 8  # choice 0 alone came, at most 8: not the 17 estimated
    accumulator.add(TextDelta("x" * 20, choice=1))
    assert build_record(request, principal, settings, "e", accumulator, 499, 1.0
                        ).completion_tokens == 8 + 5
    accumulator.add(TextDelta("x" * 400, choice=1))
    assert build_record(request, principal, settings, "e", accumulator, 499, 1.0
                        ).completion_tokens == 16


def test_a_cut_stream_bills_at_least_one_token_per_delta_sent() -> None:
    """Digits are a token or two each: 32 one-character deltas were billed 8 (~4 characters a
    token); each non-empty delta (text, reasoning, a tool call's name or arguments) holds at
    least one token."""
    request = CanonicalRequest("r1", "m", messages=[Message("user", "hi")], stream=True, n=2)
    accumulator = Accumulator()
    accumulator.add(PromptUsage(38, 16))
    for digit in "0123456789" * 3 + "01":
        accumulator.add(TextDelta(digit))
    accumulator.add(TextDelta(""))  # no token
    accumulator.add(ToolCallDelta(0, id="call_1", name="f", arguments=""))
    accumulator.add(ToolCallDelta(0, arguments="{"))
    accumulator.add(TextDelta("Hello there, how are", choice=1))  # one delta, 5 by characters
    record = build_record(request, Principal(project="p", key_id="k", scopes=frozenset()),
                          ModelSettings(name="m", endpoints=("http://127.0.0.1:1",)),
                          "e", accumulator, 499, 1.0)
    assert record.completion_tokens == (32 + 2) + 5


_DIALECTS = {  # path -> (body, is this SSE data line a non-empty text delta)
    "/v1/chat/completions": (
        {"messages": [{"role": "user", "content": "count"}]},
        lambda event: bool(event.get("choices") and event["choices"][0]["delta"].get("content"))),
    "/v1/messages": (
        {"messages": [{"role": "user", "content": "count"}], "max_tokens": 1000},
        lambda event: (event.get("type") == "content_block_delta"
                       and bool(event["delta"].get("text")))),
    "/v1/responses": (
        {"input": "count"},
        lambda event: (event.get("type") == "response.output_text.delta"
                       and bool(event.get("delta")))),
}
_NUM_DIGITS = 40


def _digit_upstream(loop_thread: LoopThread, dies: bool) -> tuple[web.AppRunner, str]:
    """A plain OpenAI-compatible upstream streaming one digit a chunk and no usage: one that
    `dies` closes the connection after _NUM_DIGITS chunks (no [DONE]); else it streams slowly
    until the client goes."""

    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for i in range(_NUM_DIGITS if dies else 2000):
            chunk = {"choices": [{"index": 0, "delta": {"content": str(i % 10)},
                                  "finish_reason": None}]}
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            await asyncio.sleep(0.003 if dies else 0.01)
        request.transport.close()  # type: ignore[union-attr]
        return response

    return start_chat_upstream(loop_thread, chat)


def _sent_deltas(lines: Iterator[str], is_delta: Callable[[dict[str, Any]], bool],
                 stop_after: int | None = None) -> int:
    num_deltas = 0
    for line in lines:
        if line.startswith("data: {"):
            num_deltas += is_delta(orjson.loads(line[6:]))
            if num_deltas == stop_after:
                break
    return num_deltas


def _gateway_over(make_gateway: GatewayFactory, url: str) -> Any:
    """A gateway serving MODEL from the plain OpenAI-compatible upstream at `url`."""
    return make_gateway(num_upstreams=0, configs=[], models=[
        {"name": MODEL, "backend": "openai", "endpoints": [url]}])


def _the_one_record(gateway: Any, request_id: str) -> Any:
    """The request's usage record, once settled, after checking it stays the only one."""
    assert wait_until(lambda: request_id in gateway.meter.settled)
    time.sleep(0.1)  # (a second settle would have landed by now)
    assert gateway.meter.num_settle_calls == 1
    return gateway.meter.settled[request_id]


@pytest.mark.parametrize("path", list(_DIALECTS))
def test_a_stream_its_upstream_cut_bills_at_least_the_deltas_the_client_got(
        path: str, make_gateway: GatewayFactory, loop_thread: LoopThread) -> None:
    """Every dialect's stream: 40 digits went out, once billed 10 (~4 characters a token)."""
    runner, url = _digit_upstream(loop_thread, dies=True)
    try:
        gateway = _gateway_over(make_gateway, url)
        body, is_delta = _DIALECTS[path]
        with httpx.stream("POST", gateway.url + path,
                          json={"model": MODEL, "stream": True, **body}, timeout=30) as response:
            assert response.status_code == 200
            request_id = response.headers["x-request-id"]
            num_deltas = _sent_deltas(response.iter_lines(), is_delta)
        assert 1 <= num_deltas <= _NUM_DIGITS  # (chunks that came together are merged)
        record = _the_one_record(gateway, request_id)
        assert record.finish_reason == "error"
        assert record.completion_tokens >= num_deltas
        assert record.completion_tokens <= _NUM_DIGITS  # one character: at most one token
    finally:
        loop_thread.run(runner.cleanup())


def test_a_stream_its_client_left_bills_at_least_the_deltas_the_client_got(
        make_gateway: GatewayFactory, loop_thread: LoopThread) -> None:
    runner, url = _digit_upstream(loop_thread, dies=False)
    try:
        gateway = _gateway_over(make_gateway, url)
        body, is_delta = _DIALECTS["/v1/chat/completions"]
        with httpx.stream("POST", gateway.url + "/v1/chat/completions",
                          json={"model": MODEL, "stream": True, **body}, timeout=30) as response:
            request_id = response.headers["x-request-id"]
            assert _sent_deltas(response.iter_lines(), is_delta, stop_after=32) == 32
        record = _the_one_record(gateway, request_id)
        assert record.status == 499 and record.completion_tokens >= 32
    finally:
        loop_thread.run(runner.cleanup())


def test_a_whole_stream_without_usage_bills_at_least_the_deltas_the_client_got(
        make_gateway: GatewayFactory, loop_thread: LoopThread) -> None:
    """A plain upstream that never sends usage (no tokenizer configured): the same lower bound
    on the completion the gateway counts itself."""

    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for i in range(_NUM_DIGITS):
            chunk = {"choices": [{"index": 0, "delta": {"content": str(i % 10)},
                                  "finish_reason": None}]}
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            await asyncio.sleep(0.003)
        await write_sse(response, ({"choices": [{"index": 0, "delta": {},
                                                 "finish_reason": "stop"}]},))
        return response

    runner, url = start_chat_upstream(loop_thread, chat)
    try:
        gateway = _gateway_over(make_gateway, url)
        body, is_delta = _DIALECTS["/v1/chat/completions"]
        with httpx.stream("POST", gateway.url + "/v1/chat/completions",
                          json={"model": MODEL, "stream": True, **body}, timeout=30) as response:
            request_id = response.headers["x-request-id"]
            num_deltas = _sent_deltas(response.iter_lines(), is_delta)
        record = _the_one_record(gateway, request_id)
        assert record.finish_reason == "stop"
        assert num_deltas <= record.completion_tokens <= _NUM_DIGITS
    finally:
        loop_thread.run(runner.cleanup())
