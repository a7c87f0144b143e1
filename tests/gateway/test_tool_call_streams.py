"""Streamed tool calls from OpenAI-compatible upstreams that do not send OpenAI's exact form (the
call's id and name on its first piece only): each SDK still assembles one call per call."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import openai
import pytest
from aiohttp import web

from tests.gateway.conftest import (
    MODEL,
    GatewayFactory,
    LoopThread,
    start_chat_upstream,
    write_sse,
)


def _piece(index: int, arguments: str, call_id: str | None, name: str | None) -> dict[str, Any]:
    call: dict[str, Any] = {"index": index, "type": "function",
                            "function": {"arguments": arguments}}
    if call_id is not None:
        call["id"] = call_id
    if name is not None:
        call["function"]["name"] = name
    return {"choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}]}


# each upstream streams read({"path": "a.py"}) and, as call 1, sh({"cmd": "ls"})
REPEATS_ID_AND_NAME = [_piece(0, "", "call_a", "read"), _piece(0, '{"path": ', "call_a", "read"),
                       _piece(0, '"a.py"}', "call_a", "read"),
                       _piece(1, '{"cmd": ', "call_b", "sh"), _piece(1, '"ls"}', "call_b", "sh")]
SENDS_NO_IDS = [_piece(0, '{"path": ', None, "read"), _piece(0, '"a.py"}', None, None),
                _piece(1, '{"cmd": "ls"}', None, "sh")]


@pytest.fixture(params=[REPEATS_ID_AND_NAME, SENDS_NO_IDS], ids=["repeats_id_and_name", "no_ids"])
def gateway_url(request: pytest.FixtureRequest, make_gateway: GatewayFactory,
                loop_thread: LoopThread) -> Any:
    pieces = request.param

    async def chat(http_request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(http_request)
        await write_sse(response, [
            {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]},
            *pieces, {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
            {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 7}}])
        return response

    runner, url = start_chat_upstream(loop_thread, chat)
    gateway = make_gateway(num_upstreams=0, configs=[], models=[
        {"name": MODEL, "backend": "openai", "endpoints": [url]}])
    yield gateway.url
    loop_thread.run(runner.cleanup())


def test_openai_stream_helper_assembles_each_call_once(gateway_url: str,
                                                       request: pytest.FixtureRequest) -> None:
    client = openai.OpenAI(base_url=gateway_url + "/v1", api_key="x", max_retries=0)
    tools: Any = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
                  for n in ("read", "sh")]
    with client.chat.completions.stream(model=MODEL, tools=tools,
                                        messages=[{"role": "user", "content": "go"}]) as stream:
        calls = stream.get_final_completion().choices[0].message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("read", '{"path": "a.py"}'), ("sh", '{"cmd": "ls"}')]
    ids = [c.id for c in calls]  # the upstream's, else made up: the client answers by them
    assert all(i and i.startswith("call_") for i in ids) and len(set(ids)) == 2
    if "repeats_id_and_name" in request.node.name:
        assert ids == ["call_a", "call_b"]


def test_anthropic_stream_has_one_tool_use_block_per_call(gateway_url: str) -> None:
    client = anthropic.Anthropic(base_url=gateway_url + "/anthropic", api_key="x", max_retries=0)
    with client.messages.stream(model=MODEL, max_tokens=16,
                                messages=[{"role": "user", "content": "go"}]) as stream:
        content = stream.get_final_message().content
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in content] == [
        ("tool_use", "read", {"path": "a.py"}), ("tool_use", "sh", {"cmd": "ls"})]


def test_responses_stream_has_one_function_call_item_per_call(gateway_url: str) -> None:
    client = openai.OpenAI(base_url=gateway_url + "/v1", api_key="x", max_retries=0)
    with client.responses.stream(model=MODEL, input="go") as stream:
        output = stream.get_final_response().output
    assert [(o.type, getattr(o, "name", None), getattr(o, "arguments", None)) for o in output] == [
        ("function_call", "read", '{"path": "a.py"}'), ("function_call", "sh", '{"cmd": "ls"}')]


CALL = {"id": "c1", "type": "function", "function": {"name": "read", "arguments": {"path": "a.py"}}}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "go"}]}


@pytest.mark.parametrize("stream", [False, True])
def test_arguments_sent_as_an_object_and_content_as_parts_are_taken_as_text(
        make_gateway: GatewayFactory, loop_thread: LoopThread, stream: bool) -> None:
    """Off-spec, seen from some servers: it was a 500 (and a cut stream)."""
    message = {"role": "assistant", "content": [{"type": "text", "text": "Reading."}],
               "tool_calls": [CALL]}

    async def chat(http_request: web.Request) -> web.StreamResponse:
        if not (await http_request.json()).get("stream"):
            return web.json_response({"choices": [{"index": 0, "message": message,
                                                   "finish_reason": "tool_calls"}]})
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(http_request)
        await write_sse(response, [{"choices": [{"index": 0, "delta": {
            **message, "tool_calls": [{**CALL, "index": 0}]}, "finish_reason": "tool_calls"}]}])
        return response

    runner, url = start_chat_upstream(loop_thread, chat)
    try:
        gateway = make_gateway(num_upstreams=0, configs=[], models=[
            {"name": MODEL, "backend": "openai", "endpoints": [url]}])
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
        if stream:
            with client.chat.completions.stream(**CHAT) as events:  # type: ignore[arg-type]
                answer = events.get_final_completion().choices[0].message
        else:
            answer = client.chat.completions.create(**CHAT).choices[0].message  # type: ignore[arg-type]
        assert answer.content == "Reading."
        assert [(c.id, c.function.arguments) for c in answer.tool_calls or []] == [  # type: ignore[union-attr]
            ("c1", '{"path":"a.py"}')]
    finally:
        loop_thread.run(runner.cleanup())


@pytest.mark.parametrize("choice", [
    {"index": 0, "delta": "text"}, {"index": 0, "delta": {"tool_calls": [{"index": "0"}]}},
    {"index": 0, "delta": {"tool_calls": "read"}},
    {"index": 0, "delta": {}, "finish_reason": {"why": "stop"}},
])
def test_a_malformed_upstream_answer_is_a_502_not_a_500(make_gateway: GatewayFactory,
                                                         loop_thread: LoopThread,
                                                         choice: dict[str, Any]) -> None:
    async def chat(http_request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(http_request)
        await write_sse(response, [{"choices": [choice]}])
        return response

    runner, url = start_chat_upstream(loop_thread, chat)
    try:
        gateway = make_gateway(num_upstreams=0, configs=[], models=[
            {"name": MODEL, "backend": "openai", "endpoints": [url]}])
        response = httpx.post(gateway.url + "/v1/chat/completions", json={**CHAT, "stream": True})
        assert response.status_code == 502, response.text
        assert response.json()["error"]["message"].startswith("upstream sent a ")
    finally:
        loop_thread.run(runner.cleanup())
