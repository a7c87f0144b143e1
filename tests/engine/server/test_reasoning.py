"""Reasoning through the replica's OpenAI server with the official SDK: a tokenizer carrying the
real Qwen3 template (`<think>`) and one speaking harmony (gpt-oss, openai-harmony) behind the fake
engine, which replies with the scripted text's token ids."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import openai
import orjson
import pytest

from tests.chat.tokenizers import HarmonyTokenizer, qwen3_like_tokenizer
from tests.engine.server.fakes import FakeEngine

REASONING = "The user greets me. I should greet back."
THINKING_REPLY = f"<think>\n{REASONING}\n</think>\n\nHello there!"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def engine(request: pytest.FixtureRequest) -> Any:
    kind = getattr(request, "param", "qwen3")
    if kind == "plain":
        return FakeEngine()
    if kind == "harmony":
        fake = FakeEngine(tokenizer=HarmonyTokenizer(), max_model_len=4096)
        fake.model_config = replace(fake.model_config, architecture="gpt_oss")
        return fake
    return FakeEngine(tokenizer=qwen3_like_tokenizer(), reply=THINKING_REPLY, max_model_len=4096)


def _extra(obj: Any, name: str) -> Any:
    return (obj.model_extra or {}).get(name)


def test_thinking_comes_back_as_reasoning_content_and_counts_in_usage(
        client: openai.OpenAI, fake_engine: FakeEngine, model: str) -> None:
    answer = client.chat.completions.create(model=model, messages=ASK)  # type: ignore[arg-type]
    message = answer.choices[0].message
    assert message.content == "Hello there!" and _extra(message, "reasoning_content") == REASONING
    num_reasoning = len(fake_engine.tokenizer.encode(f"<think>\n{REASONING}\n</think>"))
    assert answer.usage.completion_tokens_details.reasoning_tokens == num_reasoning  # type: ignore[union-attr]
    assert answer.usage.completion_tokens > num_reasoning  # type: ignore[union-attr]


def test_streamed_thinking_arrives_as_reasoning_content_deltas(
        client: openai.OpenAI, fake_engine: FakeEngine, model: str) -> None:
    chunks = list(client.chat.completions.create(
        model=model, messages=ASK, stream=True, stream_options={"include_usage": True}))  # type: ignore[arg-type]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(_extra(d, "reasoning_content") or "" for d in deltas) == REASONING
    assert "".join(d.content or "" for d in deltas) == "Hello there!"
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens_details.reasoning_tokens > 0  # type: ignore[union-attr]


@pytest.mark.parametrize("body", [{"chat_template_kwargs": {"enable_thinking": False}},
                                  {"reasoning_effort": "none"}])
def test_thinking_off_renders_the_empty_block_and_the_answer_is_content(
        client: openai.OpenAI, fake_engine: FakeEngine, model: str, body: dict[str, Any]) -> None:
    fake_engine.reply = "Hello there!"
    answer = client.chat.completions.create(model=model, messages=ASK, extra_body=body)  # type: ignore[arg-type]
    assert fake_engine.prompt_text(fake_engine.calls[0]).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert answer.choices[0].message.content == "Hello there!"
    assert _extra(answer.choices[0].message, "reasoning_content") is None
    assert answer.usage.completion_tokens_details.reasoning_tokens == 0  # type: ignore[union-attr]


def test_template_kwargs_cannot_replace_the_templates_own_variables(
        client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        client.chat.completions.create(model=model, messages=ASK,  # type: ignore[arg-type]
                                       extra_body={"chat_template_kwargs": {"messages": []}})


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_then_a_tool_call(client: openai.OpenAI, fake_engine: FakeEngine, model: str,
                                    stream: bool) -> None:
    fake_engine.reply = f"<think>\n{REASONING}\n</think>\n\n{CALL}"
    answer = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, stream=stream)  # type: ignore[arg-type]
    if stream:
        deltas = [c.choices[0].delta for c in answer if c.choices]  # type: ignore[union-attr]
        reasoning = "".join(_extra(d, "reasoning_content") or "" for d in deltas)
        calls = [call.function for d in deltas for call in d.tool_calls or ()]
        content = "".join(d.content or "" for d in deltas)
    else:
        message = answer.choices[0].message  # type: ignore[union-attr]
        reasoning, content = _extra(message, "reasoning_content"), message.content or ""
        calls = [call.function for call in message.tool_calls or ()]
    assert reasoning == REASONING and content == ""
    assert ([(c.name, orjson.loads(c.arguments)) for c in calls]  # type: ignore[union-attr]
            == [("get_weather", {"city": "Paris"})])


def test_a_past_turns_reasoning_reaches_the_template(client: openai.OpenAI,
                                                     fake_engine: FakeEngine, model: str) -> None:
    """Qwen3's template keeps the reasoning of the turns after the last user message (a tool
    loop in progress), read from `reasoning_content`."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [call],
                      "reasoning_content": "Look the weather up."},
               {"role": "tool", "tool_call_id": "call_1", "content": "20 C"}]
    client.chat.completions.create(model=model, messages=history, tools=TOOLS)  # type: ignore[arg-type]
    assert ("<|im_start|>assistant\n<think>\nLook the weather up.\n</think>\n\n<tool_call>"
            in fake_engine.prompt_text(fake_engine.calls[0]))


HARMONY_ANSWER = ("<|channel|>analysis<|message|>User says hi. Reply briefly.<|end|>"
                  "<|start|>assistant<|channel|>final<|message|>Hi! How can I help?")
HARMONY_CALL = ("<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant"
                "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                '{"city":"Paris"}')


@pytest.mark.parametrize("engine", ["harmony"], indirect=True)
@pytest.mark.parametrize("stream", [False, True])
def test_gpt_oss_analysis_is_reasoning_and_effort_reaches_the_system_message(
        client: openai.OpenAI, fake_engine: FakeEngine, model: str, stream: bool) -> None:
    fake_engine.reply = HARMONY_ANSWER
    answer = client.chat.completions.create(model=model, messages=ASK, stream=stream,  # type: ignore[arg-type]
                                            reasoning_effort="high")
    assert "\nReasoning: high\n" in fake_engine.prompt_text(fake_engine.calls[0])
    if stream:
        deltas = [c.choices[0].delta for c in answer if c.choices]  # type: ignore[union-attr]
        reasoning = "".join(_extra(d, "reasoning_content") or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
    else:
        message = answer.choices[0].message  # type: ignore[union-attr]
        reasoning, content = _extra(message, "reasoning_content"), message.content
        assert answer.usage.completion_tokens_details.reasoning_tokens == len(  # type: ignore[union-attr]
            fake_engine.tokenizer.encode(HARMONY_ANSWER[:HARMONY_ANSWER.index("<|start|>")]))
    assert (reasoning, content) == ("User says hi. Reply briefly.", "Hi! How can I help?")


@pytest.mark.parametrize("engine", ["harmony"], indirect=True)
@pytest.mark.parametrize("stream", [False, True])
def test_gpt_oss_commentary_call_is_a_tool_call(client: openai.OpenAI, fake_engine: FakeEngine,
                                                model: str, stream: bool) -> None:
    fake_engine.reply = HARMONY_CALL
    fake_engine.eos_token_id = 200012  # the turn ends on <|call|>
    answer = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, stream=stream)  # type: ignore[arg-type]
    if stream:
        chunks = [c for c in answer if c.choices]  # type: ignore[union-attr]
        calls = [call.function for c in chunks for call in c.choices[0].delta.tool_calls or ()]
        finish = chunks[-1].choices[0].finish_reason
    else:
        calls = [c.function for c in answer.choices[0].message.tool_calls or ()]  # type: ignore[union-attr]
        finish = answer.choices[0].finish_reason  # type: ignore[union-attr]
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city":"Paris"}')]
    assert finish == "tool_calls"
    assert "namespace functions" in fake_engine.prompt_text(fake_engine.calls[0])


@pytest.mark.parametrize("engine", ["plain"], indirect=True)
def test_a_family_without_reasoning_sends_no_reasoning_fields(http: Any, model: str) -> None:
    body = http.post("/v1/chat/completions", json={"model": model, "messages": ASK}).json()
    assert "reasoning_content" not in body["choices"][0]["message"]
    assert "completion_tokens_details" not in body["usage"]


@pytest.mark.parametrize("engine", ["harmony"], indirect=True)
def test_a_forced_gpt_oss_call_is_decoded_under_harmonys_call_grammar(
        client: openai.OpenAI, fake_engine: FakeEngine, model: str) -> None:
    fake_engine.reply = HARMONY_CALL
    fake_engine.eos_token_id = 200012
    answer = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert answer.choices[0].finish_reason == "tool_calls"
    grammar = fake_engine.calls[0].params.grammar
    assert grammar is not None and grammar.kind == "lark"
    assert '<|channel|> "commentary to=functions.get_weather " <|constrain|>' in grammar.text
    assert '"additionalProperties":false' in grammar.text
