"""Request fields are applied, forwarded or refused, never silently dropped; the Responses and
Anthropic answers report what happened (incomplete status, instructions, the matched stop
string)."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from bench.mock_upstream import MockConfig
from tests.gateway.conftest import (
    MODEL,
    GatewayFactory,
    LoopThread,
    start_chat_upstream,
    write_sse,
)

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {**CHAT, "max_tokens": 5}


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {**CHAT, "top_p": 0}, "top_p"),
    ("/v1/responses", {"model": MODEL, "input": "hi", "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {**CHAT, "stop": [""]}, "stop"),
    ("/v1/chat/completions", {**CHAT, "stop": ["x" * 513]}, "stop"),  # over MAX_STOP_BYTES
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": "\u00e9" * 257}, "stop"),
    ("/v1/messages", {**MESSAGES, "stop_sequences": ["END", "x" * 513]}, "stop_sequences"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ("/v1/chat/completions",
     {**CHAT, "response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format.json_schema.name"),
    ("/v1/chat/completions", {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 3}, "top_logprobs"),  # without logprobs
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 6}, "logprobs"),
    ("/v1/responses", {"model": MODEL, "input": "hi", "text": {"format": {"type": "yaml"}}},
     "text.format.type"),
    ("/v1/responses", {"model": MODEL, "input": "hi", "text": {"format": {"type": "json_schema"}}},
     "text.format.name"),
])
def test_values_the_replica_would_refuse_are_a_400_naming_the_param(
        gateway: Any, path: str, body: dict[str, Any], param: str) -> None:
    response = httpx.post(gateway.url + path, json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    # (Anthropic's envelope has no `param`: its message starts with the field's name)
    assert error["param"] if "param" in error else error["message"].startswith(f"{param}:")
    assert error.get("param", param) == param


def test_stop_strings_at_the_byte_bound_are_forwarded(gateway: Any) -> None:
    from contracts.sampling_params import MAX_STOP_BYTES

    stop = ["x" * MAX_STOP_BYTES, "\u00e9" * (MAX_STOP_BYTES // 2)]
    assert httpx.post(gateway.url + "/v1/chat/completions",
                      json={**CHAT, "stop": stop}).status_code == 200
    assert gateway.upstreams[0].state.bodies[-1]["stop"] == stop


def test_logprobs_are_forwarded_in_each_dialects_own_form(gateway: Any) -> None:
    httpx.post(gateway.url + "/v1/chat/completions",
               json={**CHAT, "logprobs": True, "top_logprobs": 2})
    chat = gateway.upstreams[0].state.bodies[-1]
    assert (chat["logprobs"], chat["top_logprobs"]) == (True, 2)
    httpx.post(gateway.url + "/v1/completions",
               json={"model": MODEL, "prompt": "hi", "logprobs": 0})
    assert gateway.upstreams[0].state.bodies[-1]["logprobs"] == 0
    httpx.post(gateway.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert "logprobs" not in gateway.upstreams[0].state.bodies[-1]


def test_anthropic_top_p_zero_and_top_k_zero_are_refused(gateway: Any) -> None:
    for extra in ({"top_p": 0}, {"top_k": 0}):
        response = httpx.post(gateway.url + "/v1/messages", json={**MESSAGES, **extra})
        assert response.status_code == 400
        assert response.json()["error"]["type"] == "invalid_request_error"


def test_anthropic_top_k_is_forwarded_to_the_upstream(gateway: Any) -> None:
    response = httpx.post(gateway.url + "/v1/messages", json={**MESSAGES, "top_k": 7})
    assert response.status_code == 200
    assert gateway.upstreams[0].state.bodies[-1]["top_k"] == 7


def test_text_response_format_is_accepted(gateway: Any) -> None:
    response = httpx.post(gateway.url + "/v1/chat/completions",
                          json={**CHAT, "response_format": {"type": "text"}, "logprobs": False})
    assert response.status_code == 200
    assert "response_format" not in gateway.upstreams[0].state.bodies[-1]


def test_parallel_tool_calls_reaches_the_upstream_only_when_given_with_tools(gateway: Any) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    httpx.post(gateway.url + "/v1/chat/completions", json={**CHAT, "tools": tools})
    assert "parallel_tool_calls" not in gateway.upstreams[0].state.bodies[-1]
    httpx.post(gateway.url + "/v1/chat/completions",
               json={**CHAT, "tools": tools, "parallel_tool_calls": False})
    assert gateway.upstreams[0].state.bodies[-1]["parallel_tool_calls"] is False
    response = httpx.post(gateway.url + "/v1/responses", json={
        "model": MODEL, "input": "hi", "parallel_tool_calls": False,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]})
    assert response.json()["parallel_tool_calls"] is False
    assert gateway.upstreams[0].state.bodies[-1]["parallel_tool_calls"] is False
    bad = httpx.post(gateway.url + "/v1/chat/completions",
                     json={**CHAT, "parallel_tool_calls": "no"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "parallel_tool_calls"


def test_penalties_are_range_checked_and_forwarded(gateway: Any) -> None:
    for path, body in (("/v1/chat/completions", CHAT),
                       ("/v1/completions", {"model": MODEL, "prompt": "hi"})):
        ok = httpx.post(gateway.url + path,
                        json={**body, "presence_penalty": 0.5, "frequency_penalty": -1})
        assert ok.status_code == 200
        sent = gateway.upstreams[0].state.bodies[-1]
        assert (sent["presence_penalty"], sent["frequency_penalty"]) == (0.5, -1.0)
        bad = httpx.post(gateway.url + path, json={**body, "frequency_penalty": 3})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "frequency_penalty"
    httpx.post(gateway.url + "/v1/chat/completions", json=CHAT)
    assert "presence_penalty" not in gateway.upstreams[0].state.bodies[-1]


def test_completions_echo_is_forwarded(gateway: Any) -> None:
    body = {"model": MODEL, "prompt": "hi", "echo": True, "logprobs": 1}
    assert httpx.post(gateway.url + "/v1/completions", json=body).status_code == 200
    assert gateway.upstreams[0].state.bodies[-1]["echo"] is True
    httpx.post(gateway.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert "echo" not in gateway.upstreams[0].state.bodies[-1]


def test_json_output_formats_reach_the_upstream_in_chats_form(gateway: Any) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    given = {"type": "json_schema",
             "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    assert httpx.post(gateway.url + "/v1/chat/completions",
                      json={**CHAT, "response_format": given}).status_code == 200
    assert gateway.upstreams[0].state.bodies[-1]["response_format"] == given
    assert httpx.post(gateway.url + "/v1/chat/completions",
                      json={**CHAT, "response_format": {"type": "json_object"}}).status_code == 200
    assert gateway.upstreams[0].state.bodies[-1]["response_format"] == {"type": "json_object"}
    flat = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    assert httpx.post(gateway.url + "/v1/responses", json={
        "model": MODEL, "input": "hi", "text": {"format": flat}}).status_code == 200
    assert gateway.upstreams[0].state.bodies[-1]["response_format"] == given


def test_responses_echoes_instructions(gateway: Any) -> None:
    response = httpx.post(gateway.url + "/v1/responses",
                          json={"model": MODEL, "input": "hi", "instructions": "Be brief."})
    assert response.status_code == 200
    assert response.json()["instructions"] == "Be brief."


def test_chat_empty_answer_is_an_empty_string_and_null_only_beside_tool_calls(
        make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(configs=[MockConfig(num_tokens=0)])
    empty = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT).json()
    assert empty["choices"][0]["message"]["content"] == ""  # OpenAI's form, not null
    tools = [{"type": "function", "function": {"name": "f"}}]
    called = httpx.post(gateway.url + "/v1/chat/completions", json={**CHAT, "tools": tools}).json()
    assert called["choices"][0]["message"]["content"] is None
    assert called["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "f"


def test_responses_echoes_a_named_tool_choice_in_the_responses_form(gateway: Any) -> None:
    choice = {"type": "function", "name": "get_weather"}
    response = httpx.post(gateway.url + "/v1/responses", json={
        "model": MODEL, "input": "hi", "tool_choice": choice,
        "tools": [{"type": "function", "name": "get_weather"}]})
    assert response.status_code == 200
    assert response.json()["tool_choice"] == choice  # not the chat form {"function": {"name"}}
    upstream = gateway.upstreams[0].state.bodies[-1]
    assert upstream["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}


def test_responses_function_call_after_assistant_text_joins_that_turn(gateway: Any) -> None:
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
    response = httpx.post(gateway.url + "/v1/responses", json={"model": MODEL, "input": [
        {"role": "user", "content": "hi"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me look."}]},
        call, {"type": "function_call_output", "call_id": "call_1", "output": "ok"}]})
    assert response.status_code == 200
    messages = gateway.upstreams[0].state.bodies[-1]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["content"] == "Let me look."
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["call_1"]


def _sse_event_names(text: str) -> list[str]:
    return [line[len("event: "):] for line in text.splitlines() if line.startswith("event: ")]


def test_responses_stream_cut_by_max_output_tokens_ends_with_response_incomplete(
        gateway: Any) -> None:
    response = httpx.post(gateway.url + "/v1/responses", json={
        "model": MODEL, "input": "hi", "max_output_tokens": 2, "stream": True})
    names = _sse_event_names(response.text)
    assert names[-1] == "response.incomplete" and "response.completed" not in names
    full = httpx.post(gateway.url + "/v1/responses", json={"model": MODEL, "input": "hi",
                                                           "stream": True})
    assert _sse_event_names(full.text)[-1] == "response.completed"


def _stop_matching_upstream(loop_thread: LoopThread) -> tuple[web.AppRunner, str]:
    """Answers like our replica (and vLLM) when the stop string "END" matched."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        choice_end = {"finish_reason": "stop", "stop_reason": "END"}
        usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        if not body.get("stream"):
            return web.json_response({"id": "x", "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "one two"}, **choice_end}],
                "usage": usage})
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await write_sse(response, (
            {"choices": [{"index": 0, "delta": {"content": "one two"}, "finish_reason": None}]},
            {"choices": [{"index": 0, "delta": {}, **choice_end}]},
            {"choices": [], "usage": usage}))
        return response

    return start_chat_upstream(loop_thread, chat)


def test_anthropic_matched_stop_sequence_is_reported_whole_and_streamed(
        make_gateway: GatewayFactory, loop_thread: LoopThread) -> None:
    runner, url = _stop_matching_upstream(loop_thread)
    try:
        gateway = make_gateway(num_upstreams=0, configs=[], models=[
            {"name": MODEL, "backend": "replica", "endpoints": [url]}])
        body = {**MESSAGES, "stop_sequences": ["END"]}
        whole = httpx.post(gateway.url + "/v1/messages", json=body).json()
        assert (whole["stop_reason"], whole["stop_sequence"]) == ("stop_sequence", "END")
        streamed = httpx.post(gateway.url + "/v1/messages", json={**body, "stream": True}).text
        deltas = [orjson.loads(line[6:]) for line in streamed.splitlines()
                  if line.startswith("data: ") and "message_delta" in line]
        assert deltas[-1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    finally:
        loop_thread.run(runner.cleanup())


def test_gateway_reuses_the_replica_sampling_checks_without_importing_torch() -> None:
    import subprocess
    import sys

    code = "import sys, gateway.web.app, gateway.dialects.validate; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=True)
    assert result.stdout.strip() == "False"


def _nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": _nested_schema(300)}}},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": _nested_schema(300)}}}}]},
])
def test_a_schema_nested_deeper_than_the_upstream_body_can_be_written_is_400(
        gateway: Any, fields: dict[str, Any]) -> None:
    """The client's body is read up to 1024 levels, the upstream's written up to 254 (orjson)."""
    response = httpx.post(gateway.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields})
    assert response.status_code == 400, response.text
    assert "nested too deeply" in response.json()["error"]["message"]
    assert gateway.upstreams[0].state.bodies == []
