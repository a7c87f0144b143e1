"""The native `anthropic` backend: our dialects reach a Claude-style Messages API upstream (a
fake written from Anthropic's documented wire format: tests/gateway/anthropic_upstream.py),
driven through the official openai and anthropic SDKs: text, streaming, tools both ways,
cache_control passed through, cache creation/read tokens in the ledger, errors mapped."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
import pytest

from tests.gateway.anthropic_upstream import TOOL_INPUT, AnthropicState, create_anthropic_app
from tests.gateway.conftest import GatewayFactory, LoopThread, start_app, wait_until
from tests.gateway.test_auth_seam import KeyAuthenticator, RecordingMeter

MODEL = "claude-test"
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the weather",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}}}}]


@pytest.fixture
def served(make_gateway: GatewayFactory, loop_thread: LoopThread) -> Any:
    state = AnthropicState()
    runner, url = loop_thread.run(start_app(create_anthropic_app(state)))
    meter = RecordingMeter()
    gateway = make_gateway(num_upstreams=0, configs=[], authenticator=KeyAuthenticator(),
                           meter=meter, num_retries=0, models=[
                               {"name": MODEL, "backend": "anthropic", "endpoints": [url],
                                "api_key": "sk-ant-upstream"}])
    yield gateway, state, meter
    loop_thread.run(runner.cleanup())


def _openai(gateway: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="good", max_retries=0)


def test_openai_chat_reaches_claude_plain_and_streamed_with_usage_metered(served: Any) -> None:
    gateway, state, meter = served
    client = _openai(gateway)
    answer = client.chat.completions.create(
        model=MODEL, max_tokens=50, temperature=1.5, stop=["END"],
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content == "Hello from Claude"
    assert answer.choices[0].finish_reason == "stop"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (12, 7)
    sent = state.bodies[-1]
    assert sent["system"] == [{"type": "text", "text": "Be brief."}]
    assert sent["messages"] == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert (sent["max_tokens"], sent["temperature"], sent["stop_sequences"]) == (50, 1.0, ["END"])
    assert state.headers[-1]["x-api-key"] == "sk-ant-upstream"
    assert state.headers[-1]["anthropic-version"] == "2023-06-01"
    chunks = list(client.chat.completions.create(
        model=MODEL, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "hi"}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        "Hello from Claude"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 7
    assert wait_until(lambda: len(meter.settled) == 2)
    assert [(r.prompt_tokens, r.completion_tokens, r.status) for r in meter.settled] == [
        (12, 7, 200), (12, 7, 200)]


def test_cache_control_passes_through_and_cache_tokens_reach_the_ledger(served: Any) -> None:
    gateway, state, meter = served
    client = anthropic.Anthropic(base_url=gateway.url, api_key="good", max_retries=0)
    system = [{"type": "text", "text": "A long shared system prompt.",
               "cache_control": {"type": "ephemeral"}}]
    first = client.messages.create(model=MODEL, max_tokens=20, system=system,
                                   messages=[{"role": "user", "content": "hi"}])
    assert state.bodies[-1]["system"][0]["cache_control"] == {"type": "ephemeral"}
    with client.messages.stream(model=MODEL, max_tokens=20, system=system,
                                messages=[{"role": "user", "content": "hi"}]) as stream:
        second = stream.get_final_message()
    assert first.content[0].text == second.content[0].text == "Hello from Claude"  # type: ignore[union-attr]
    assert wait_until(lambda: len(meter.settled) == 2)
    # written: 12 + 100 created, none read; then 12 + 100 read
    assert [(r.prompt_tokens, r.cached_tokens) for r in meter.settled] == [(112, 0), (112, 100)]
    assert second.usage.cache_read_input_tokens == 100


def test_tools_round_trip_through_claude(served: Any) -> None:
    gateway, state, _ = served
    client = _openai(gateway)
    messages: list[Any] = [{"role": "user", "content": "call the tool for Paris"}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                                 tool_choice="required", stream=True,
                                                 parallel_tool_calls=False))
    calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices
             and c.choices[0].delta.tool_calls]
    assert calls[0][0].id == "toolu_01" and calls[0][0].function.name == "weather"
    arguments = "".join(call[0].function.arguments or "" for call in calls)
    assert json.loads(arguments) == TOOL_INPUT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    sent = state.bodies[-1]
    assert sent["tools"][0]["input_schema"]["properties"] == {"city": {"type": "string"}}
    assert sent["tool_choice"] == {"type": "any", "disable_parallel_tool_use": True}
    messages += [{"role": "assistant", "tool_calls": [{"id": "toolu_01", "type": "function",
                                                       "function": {"name": "weather",
                                                                    "arguments": arguments}}]},
                 {"role": "tool", "tool_call_id": "toolu_01", "content": "18 degrees"},
                 {"role": "user", "content": "thanks"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    assert answer.choices[0].message.content == "Hello from Claude"
    assert state.bodies[-1]["messages"][1:] == [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_01",
                                           "name": "weather", "input": TOOL_INPUT}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": "18 degrees"},
            {"type": "text", "text": "thanks"}]}]


def test_claude_errors_reach_each_dialect_mapped(served: Any) -> None:
    gateway, _, _ = served
    client = _openai(gateway)
    with pytest.raises(openai.RateLimitError) as throttled:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                               "content": "throttle"}])
    assert throttled.value.response.headers["retry-after"] == "23"
    assert throttled.value.response.headers["anthropic-ratelimit-requests-remaining"] == "0"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                               "content": "too long"}])
    assert too_long.value.code == "context_length_exceeded"
    claude = anthropic.Anthropic(base_url=gateway.url, api_key="good", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model=MODEL, max_tokens=5,
                               messages=[{"role": "user", "content": "too long"}])
    assert "prompt is too long" in refused.value.message
    with pytest.raises(anthropic.APIStatusError) as broken, \
            claude.messages.stream(model=MODEL, max_tokens=5,
                                   messages=[{"role": "user", "content": "break"}]) as stream:
        stream.get_final_message()  # the first text came: the stream ends in an error event
    assert "Overloaded" in str(broken.value) or "overloaded" in str(broken.value).lower()
    with pytest.raises(openai.BadRequestError):  # completions need a prompt-taking upstream
        client.completions.create(model=MODEL, prompt="hi")
