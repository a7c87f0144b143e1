"""Reasoning and forced tool calls through the gateway, in every dialect, with the official SDKs:
a replica server (the real Qwen3 template over the fake engine) behind `aigw`'s app. The replica
answers OpenAI-shaped (`reasoning_content`); the dialects make Responses reasoning items and
Anthropic thinking blocks of it, and the usage record counts the reasoning tokens."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from engine.server import ReplicaServerSettings
from tests.chat.tokenizers import qwen3_like_tokenizer
from tests.engine.server.conftest import ServerThread
from tests.engine.server.fakes import FakeEngine
from tests.gateway.conftest import GatewayFactory, wait_until

REASONING = "The user greets me. I should greet back."
REPLY = f"<think>\n{REASONING}\n</think>\n\nHello there!"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ASK = [{"role": "user", "content": "Hi"}]
WEATHER = {"name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
MODEL = "fake-model"


@pytest.fixture
def replica() -> Iterator[tuple[FakeEngine, str]]:
    fake = FakeEngine(tokenizer=qwen3_like_tokenizer(), reply=REPLY, max_model_len=4096)
    thread = ServerThread(fake, ReplicaServerSettings())
    thread.start()
    yield fake, thread.base_url
    thread.stop()


@pytest.fixture
def served(replica: tuple[FakeEngine, str], make_gateway: GatewayFactory) -> Any:
    fake, url = replica
    gateway = make_gateway(models=[{"name": MODEL, "backend": "replica", "endpoints": [url]}],
                           first_token_timeout_s=30.0, idle_timeout_s=30.0)
    return fake, gateway


def _prompt(fake: FakeEngine) -> str:
    return fake.prompt_text(fake.calls[-1])


@pytest.mark.parametrize("stream", [False, True])
def test_openai_chat_passes_reasoning_content_and_meters_its_tokens(served: Any,
                                                                    stream: bool) -> None:
    fake, gateway = served
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    if stream:
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=ASK, stream=True, stream_options={"include_usage": True}))  # type: ignore[arg-type]
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
        usage = chunks[-1].usage
    else:
        answer = client.chat.completions.create(model=MODEL, messages=ASK)  # type: ignore[arg-type]
        reasoning = (answer.choices[0].message.model_extra or {}).get("reasoning_content")
        content, usage = answer.choices[0].message.content, answer.usage
    num_reasoning = len(fake.tokenizer.encode(f"<think>\n{REASONING}\n</think>"))
    assert (reasoning, content) == (REASONING, "Hello there!")
    assert usage is not None and usage.completion_tokens_details.reasoning_tokens == num_reasoning  # type: ignore[union-attr]
    assert wait_until(lambda: len(gateway.meter.settled) == 1)
    (record,) = gateway.meter.settled.values()
    assert record.reasoning_tokens == num_reasoning < record.completion_tokens


def test_openai_chat_sends_reasoning_effort_and_template_kwargs_upstream(served: Any) -> None:
    fake, gateway = served
    fake.reply = "Hello there!"
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    client.chat.completions.create(model=MODEL, messages=ASK,  # type: ignore[arg-type]
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert _prompt(fake).endswith("<think>\n\n</think>\n\n")
    client.chat.completions.create(model=MODEL, messages=ASK, reasoning_effort="none")  # type: ignore[arg-type]
    assert _prompt(fake).endswith("<think>\n\n</think>\n\n")
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        client.chat.completions.create(model=MODEL, messages=ASK,  # type: ignore[arg-type]
                                       extra_body={"reasoning_effort": "maximal"})


def test_responses_reasoning_is_a_reasoning_item_before_the_message(served: Any) -> None:
    _, gateway = served
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    response = client.responses.create(model=MODEL, input="Hi")
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"]
    reasoning = response.output[0]
    assert [c.text for c in reasoning.content or ()] == [REASONING] and reasoning.summary == []  # type: ignore[union-attr]
    assert response.output_text == "Hello there!"
    assert response.usage is not None and response.usage.output_tokens_details.reasoning_tokens > 0


def test_responses_stream_sends_reasoning_text_events(served: Any) -> None:
    fake, gateway = served
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    with client.responses.stream(model=MODEL, input="Hi", reasoning={"effort": "low"}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == REASONING
    done = [e for e in events if e.type == "response.reasoning_text.done"]
    assert [e.text for e in done] == [REASONING]
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text == "Hello there!"


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_thinking_blocks_carry_a_signature(served: Any, stream: bool) -> None:
    _, gateway = served
    client = anthropic.Anthropic(base_url=gateway.url + "/anthropic", api_key="x", max_retries=0)
    ask: dict[str, Any] = {"model": MODEL, "max_tokens": 256, "messages": ASK,
                           "thinking": {"type": "enabled", "budget_tokens": 1024}}
    if stream:
        with client.messages.stream(**ask) as events:
            kinds = [e.delta.type for e in events if e.type == "content_block_delta"]
            message = events.get_final_message()
        assert "thinking_delta" in kinds and "signature_delta" in kinds
    else:
        message = client.messages.create(**ask)
    thinking, text = message.content
    assert thinking.type == "thinking" and thinking.thinking == REASONING
    assert thinking.signature
    assert text.type == "text" and text.text == "Hello there!"


def test_anthropic_thinking_disabled_turns_qwen3_thinking_off(served: Any) -> None:
    fake, gateway = served
    fake.reply = "Hello there!"
    client = anthropic.Anthropic(base_url=gateway.url + "/anthropic", api_key="x", max_retries=0)
    message = client.messages.create(model=MODEL, max_tokens=64, messages=ASK,  # type: ignore[arg-type]
                                     thinking={"type": "disabled"})
    assert _prompt(fake).endswith("<think>\n\n</think>\n\n")
    assert [block.type for block in message.content] == ["text"]


def test_an_earlier_thinking_block_goes_back_as_reasoning(served: Any) -> None:
    fake, gateway = served
    client = anthropic.Anthropic(base_url=gateway.url + "/anthropic", api_key="x", max_retries=0)
    history = [*ASK, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Look it up.", "signature": "x"},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "20 C"}]}]
    client.messages.create(model=MODEL, max_tokens=64, messages=history,  # type: ignore[arg-type]
                           tools=[{"name": "get_weather", "input_schema": WEATHER["parameters"]}])
    assert "<think>\nLook it up.\n</think>\n\n<tool_call>" in _prompt(fake)


def test_a_forced_call_after_reasoning_in_every_dialect(served: Any) -> None:
    fake, gateway = served
    fake.reply = f"<think>\n{REASONING}\n</think>\n\n{CALL}"
    oai = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    chat = oai.chat.completions.create(
        model=MODEL, messages=ASK, tools=[{"type": "function", "function": WEATHER}],  # type: ignore[arg-type, list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert [c.function.name for c in chat.choices[0].message.tool_calls or ()] == ["get_weather"]  # type: ignore[union-attr]
    response = oai.responses.create(model=MODEL, input="Hi", tool_choice="required",
                                    tools=[{"type": "function", **WEATHER}])  # type: ignore[list-item]
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    claude = anthropic.Anthropic(base_url=gateway.url + "/anthropic", api_key="x", max_retries=0)
    message = claude.messages.create(
        model=MODEL, max_tokens=256, messages=ASK,
        tool_choice={"type": "tool", "name": "get_weather"},  # type: ignore[arg-type]
        tools=[{"name": "get_weather", "input_schema": WEATHER["parameters"]}])
    assert [block.type for block in message.content] == ["thinking", "tool_use"]
    assert message.stop_reason == "tool_use"
    # every dialect's forced choice reached the replica as a grammar (the think format's)
    grammars = [call.params.grammar for call in fake.calls]
    assert len(grammars) == 3 and all(g is not None and "THINK" in g.text for g in grammars)


def test_a_responses_reasoning_item_goes_back_with_the_call_that_follows_it(served: Any) -> None:
    fake, gateway = served
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    client.responses.create(model=MODEL, tools=[{"type": "function", **WEATHER}], input=[  # type: ignore[list-item]
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Look it up."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "20 C"}])
    assert "<think>\nLook it up.\n</think>\n\n<tool_call>" in _prompt(fake)
