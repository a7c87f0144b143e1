"""Tool calls end to end: tools in the prompt, calls parsed out of the reply (SDK shapes)."""

from __future__ import annotations

import openai
import orjson

from tests.engine.server.fakes import FakeEngine

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL_REPLY = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
              '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')


def test_reply_with_calls_becomes_tool_calls(client: openai.OpenAI, fake_engine: FakeEngine,
                                             model: str) -> None:
    fake_engine.reply = CALL_REPLY
    completion = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS)  # type: ignore[arg-type]
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]  # type: ignore[union-attr]
    assert orjson.loads(calls[0].function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    assert all(c.type == "function" and c.id.startswith("call_") for c in calls)
    # tools went into the template
    assert "get_weather" in fake_engine.prompt_text(fake_engine.calls[0])


def test_streamed_calls_arrive_as_indexed_deltas(client: openai.OpenAI, fake_engine: FakeEngine,
                                                 model: str) -> None:
    fake_engine.reply = "Checking." + CALL_REPLY
    chunks = list(client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,  # type: ignore[arg-type]
                                                 stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert content == "Checking."
    assert [(d.index, d.function.name) for d in deltas] == [(0, "get_weather"), (1, "get_time")]  # type: ignore[union-attr]
    assert orjson.loads(deltas[0].function.arguments) == {"city": "Paris"}  # type: ignore[union-attr, arg-type]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_streamed_answer_of_calls_and_whitespace_has_no_content_as_the_whole_one(
        client: openai.OpenAI, fake_engine: FakeEngine, model: str) -> None:
    """The "\n" a model writes after its call is no text: the SDK's assembled message has none,
    as in the non-streamed answer (an Anthropic client would otherwise get a blank text block)."""
    fake_engine.reply = CALL_REPLY + "\n"
    chunks = list(client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,  # type: ignore[arg-type]
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    whole = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS)  # type: ignore[arg-type]
    assert (whole.choices[0].message.content is None
            and chunks[-1].choices[0].finish_reason == "tool_calls")


def test_a_demanded_call_to_a_tool_with_pydantic_defs_is_served(
        client: openai.OpenAI, fake_engine: FakeEngine, model: str) -> None:
    """A nested pydantic model's `$defs` refs compile in the forced-call grammar (it was a 400)."""
    fake_engine.reply = '<tool_call>\n{"name":"find","arguments":{"at":{"path":"a"}}}\n</tool_call>'
    find = {"type": "function", "function": {"name": "find", "parameters": {
        "type": "object", "$defs": {"Loc": {"type": "object", "properties": {
            "path": {"type": "string"}}, "required": ["path"]}},
        "properties": {"at": {"$ref": "#/$defs/Loc"}}, "required": ["at"]}}}
    for tool_choice in ("required", {"type": "function", "function": {"name": "find"}}):
        completion = client.chat.completions.create(model=model, messages=ASK, tools=[find],  # type: ignore[list-item]
                                                    tool_choice=tool_choice)  # type: ignore[arg-type]
        (call,) = completion.choices[0].message.tool_calls or []
        assert orjson.loads(call.function.arguments) == {"at": {"path": "a"}}  # type: ignore[union-attr]


def test_tool_choice_none_leaves_tools_out_and_text_unparsed(
        client: openai.OpenAI, fake_engine: FakeEngine, model: str) -> None:
    fake_engine.reply = CALL_REPLY
    completion = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,  # type: ignore[arg-type]
                                                tool_choice="none")
    assert completion.choices[0].message.content == CALL_REPLY
    assert completion.choices[0].finish_reason == "stop"
    assert "get_weather" not in fake_engine.prompt_text(fake_engine.calls[0])


def test_required_and_named_tool_choice_leave_the_prompt_as_auto_renders_it(
        client: openai.OpenAI, fake_engine: FakeEngine, model: str) -> None:
    """The grammar enforces a demanded call; the prompt stays the same token for token, so an agent
    that switches tool_choice between turns keeps its prefix-cache hits."""
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_time"}}):
        client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,  # type: ignore[arg-type]
                                       tool_choice=choice)  # type: ignore[arg-type]
    auto, required, named = (fake_engine.prompt_text(call) for call in fake_engine.calls)
    assert required == auto and named == auto
    assert "get_weather" in named and "get_time" in named  # every tool is offered


def test_assistant_tool_calls_and_tool_results_round_trip(
        client: openai.OpenAI, fake_engine: FakeEngine, model: str) -> None:
    client.chat.completions.create(model=model, tools=TOOLS, messages=[  # type: ignore[arg-type]
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"},
    ])
    prompt = fake_engine.prompt_text(fake_engine.calls[0])
    assert '"arguments":{"city":"Paris"}' in prompt  # arguments reach the template as an object
    assert "<|im_start|>tool\n18C and sunny" in prompt


def test_reply_without_calls_is_plain_content_when_tools_given(
        client: openai.OpenAI, fake_engine: FakeEngine, model: str) -> None:
    completion = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS)  # type: ignore[arg-type]
    assert completion.choices[0].message.content == fake_engine.reply
    assert completion.choices[0].message.tool_calls is None
    assert completion.choices[0].finish_reason == "stop"


def test_parallel_tool_calls_false_returns_only_the_first_call(
        client: openai.OpenAI, fake_engine: FakeEngine, model: str) -> None:
    """OpenAI's (and vLLM's) contract: at most one call, also with tool_choice "auto" (where no
    grammar bounds the calls); Anthropic's disable_parallel_tool_use arrives as this."""
    fake_engine.reply = CALL_REPLY
    completion = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,  # type: ignore[arg-type]
                                                parallel_tool_calls=False)
    calls = completion.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"]  # type: ignore[union-attr]
    assert completion.choices[0].finish_reason == "tool_calls"
    chunks = list(client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,  # type: ignore[arg-type]
                                                 parallel_tool_calls=False, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name) for d in deltas] == [(0, "get_weather")]  # type: ignore[union-attr]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
