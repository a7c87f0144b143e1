"""Llama 4's pythonic tool calls through the gateway with the official SDKs: a replica server over
the fake engine, which answers with a scripted text in the tiny Llama 4 checkpoint's tokens (its
byte-level BPE, tests/engine/models/_llama4.py) and a Llama-4-style template that lists the tools
and writes past calls as a pythonic list. The replica picks the llama4 format for a llama4_text
model; the gateway hands the calls on as OpenAI tool_calls and Anthropic tool_use blocks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import anthropic
import openai
import orjson
import pytest

from chat.tokenizer import load_tokenizer
from chat.tool_parsers import Llama4PythonicToolParser
from engine.server import ReplicaServerSettings
from tests.engine.models._llama4 import write_tokenizer
from tests.engine.server.conftest import ServerThread
from tests.engine.server.fakes import FakeEngine
from tests.gateway.conftest import GatewayFactory

# Llama 4's turn layout; tools listed in the system turn, past calls written as Llama 4 writes them
TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|header_start|>system<|header_end|>\n\n"
    "Call functions as [func_name(param=value, ...), ...]. Functions:\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|eot|>{% endif %}"
    "{% for m in messages %}<|header_start|>{{ 'ipython' if m.role == 'tool' else m.role }}"
    "<|header_end|>\n\n{% if m.tool_calls %}[{% for c in m.tool_calls %}{{ c.function.name }}("
    "{% for k, v in c.function.arguments.items() %}{{ k }}={{ v | tojson }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}){% if not loop.last %}, {% endif %}"
    "{% endfor %}]{% else %}{{ m.content }}{% endif %}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|header_start|>assistant<|header_end|>\n\n{% endif %}")
CALLS_ANSWER = ('[get_weather(city="Paris, FR", days=[1, 2]), '
                'search(q="umbrella [cheap]", filters={"max_eur": 20.5, "new": True})]')
CALLS = [("get_weather", {"city": "Paris, FR", "days": [1, 2]}),
         ("search", {"q": "umbrella [cheap]", "filters": {"max_eur": 20.5, "new": True}})]
WEATHER = {"name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string"}, "days": {"type": "array", "items": {"type": "integer"}}},
               "required": ["city"]}}
SEARCH = {"name": "search", "parameters": {"type": "object", "properties": {
    "q": {"type": "string"}, "filters": {"type": "object"}}}}
OPENAI_TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": SEARCH}]
ANTHROPIC_TOOLS = [{"name": t["name"], "input_schema": t["parameters"]} for t in (WEATHER, SEARCH)]
ASK = [{"role": "user", "content": "Weather in Paris, and a cheap umbrella?"}]
MODEL = "fake-model"  # the fake engine serves this name


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("llama4-tokenizer")
    write_tokenizer(directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config,
                                                                 "chat_template": TEMPLATE}))
    return directory


@pytest.fixture
def served(tokenizer_dir: Path, make_gateway: GatewayFactory) -> Iterator[tuple[FakeEngine, Any]]:
    fake = FakeEngine(tokenizer=load_tokenizer(tokenizer_dir), reply=CALLS_ANSWER,
                      max_model_len=4096)
    fake.model_config = replace(fake.model_config, architecture="llama4_text")
    thread = ServerThread(fake, ReplicaServerSettings())
    thread.start()
    gateway = make_gateway(models=[{"name": MODEL, "backend": "replica",
                                    "endpoints": [thread.base_url]}],
                           first_token_timeout_s=30.0, idle_timeout_s=30.0)
    yield fake, gateway
    thread.stop()


def _named(calls: Any) -> list[tuple[str, object]]:
    return [(c.function.name, orjson.loads(c.function.arguments)) for c in calls]


def test_openai_chat_returns_the_pythonic_calls_as_tool_calls_whole_and_streamed(
        served: Any) -> None:
    fake, gateway = served
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    answer = client.chat.completions.create(model=MODEL, messages=ASK, tools=OPENAI_TOOLS)  # type: ignore[arg-type]
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert _named(choice.message.tool_calls) == CALLS
    # the template listed the tools
    assert '"name": "get_weather"' in fake.prompt_text(fake.calls[0])
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=OPENAI_TOOLS,  # type: ignore[arg-type]
                                                 stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [d.index for d in deltas] == [0, 1] and _named(deltas) == CALLS
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_messages_return_the_calls_as_tool_use_blocks(served: Any, stream: bool) -> None:
    _, gateway = served
    client = anthropic.Anthropic(base_url=gateway.url + "/anthropic", api_key="x", max_retries=0)
    ask: dict[str, Any] = {"model": MODEL, "max_tokens": 256, "messages": ASK,
                           "tools": ANTHROPIC_TOOLS}
    if stream:
        with client.messages.stream(**ask) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**ask)
    assert message.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in message.content] == [  # type: ignore[union-attr]
        ("tool_use", name, arguments) for name, arguments in CALLS]


def test_a_text_answer_with_brackets_stays_text(served: Any) -> None:
    fake, gateway = served
    fake.reply = "[1] Meteo-France says: sunny, 21 C. (f(x=1) is no call)"
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    answer = client.chat.completions.create(model=MODEL, messages=ASK, tools=OPENAI_TOOLS)  # type: ignore[arg-type]
    assert answer.choices[0].message.content == fake.reply
    assert (answer.choices[0].message.tool_calls is None
            and answer.choices[0].finish_reason == "stop")


def test_a_forced_call_is_decoded_under_the_pythonic_grammar_and_past_calls_read_back(
        served: Any) -> None:
    fake, gateway = served
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function",
         "function": {"name": name, "arguments": orjson.dumps(arguments).decode()}}
        for i, (name, arguments) in enumerate(CALLS)]},
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 EUR"}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=OPENAI_TOOLS,  # type: ignore[arg-type]
                                            tool_choice="required")
    assert _named(answer.choices[0].message.tool_calls) == CALLS
    (call,) = fake.calls
    assert call.params.grammar is not None and '"get_weather("' in call.params.grammar.text
    # the template wrote the earlier calls as Llama 4 does; the parser reads them back
    turn = fake.prompt_text(call).split("<|header_start|>assistant<|header_end|>\n\n")[1]
    parsed = Llama4PythonicToolParser().extract(turn.split("<|eot|>")[0])
    assert [(c.name, orjson.loads(c.arguments)) for c in parsed.tool_calls] == CALLS
