"""The official openai SDK, unchanged, against the gateway over real sockets."""

from __future__ import annotations

import json

import openai
import pytest

from tests.gateway.conftest import MODEL, Gateway, wait_until

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture
def client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)


def test_chat_completion_returns_text_usage_and_gateway_headers(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}])
    completion = raw.parse()
    assert completion.choices[0].message.content == "tok " * 8
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and completion.usage.completion_tokens == 8
    assert raw.headers["x-request-id"]
    assert raw.headers["x-aigw-replica"].startswith("127.0.0.1:")
    assert float(raw.headers["x-aigw-overhead-ms"]) >= 0


def test_client_request_id_is_echoed_and_forwarded(client: openai.OpenAI, gateway: Gateway) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}],
        extra_headers={"x-request-id": "abc-123"})
    assert raw.headers["x-request-id"] == "abc-123"
    assert gateway.upstreams[0].state.request_ids[-1] == "abc-123"


def test_chat_stream_delivers_every_token_and_usage_when_asked(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "tok " * 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_chat_stream_without_include_usage_sends_no_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True))
    assert all(c.usage is None for c in chunks)


def test_upstream_always_gets_include_usage_and_a_cache_salt(client: openai.OpenAI,
                                                             gateway: Gateway) -> None:
    list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                        stream=True))
    body = gateway.upstreams[0].state.bodies[-1]
    assert body["stream_options"] == {"include_usage": True}
    assert body["cache_salt"] == "project:anonymous"  # auth.cache_salt_for, per project


def test_usage_is_settled_once_with_cost(client: openai.OpenAI, gateway: Gateway) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}])
    request_id = raw.headers["x-request-id"]
    assert wait_until(lambda: request_id in gateway.meter.settled)  # settled after the answer
    record = gateway.meter.settled[request_id]
    assert gateway.meter.num_settle_calls == 1
    assert record.completion_tokens == 8 and record.status == 200
    assert record.cost_usd == pytest.approx(record.prompt_tokens * 1e-6 + 8 * 2e-6)


def test_requests_that_reuse_a_client_request_id_are_each_billed(client: openai.OpenAI,
                                                                 gateway: Gateway) -> None:
    """x-request-id is the client's (echoed, forwarded, in the response id) but not unique: two
    requests sending the same one are two usage records, not one (the meters are idempotent on
    the record's id, so the second answer went unbilled)."""
    for _ in range(2):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}],
            extra_headers={"x-request-id": "same-id"})
        assert raw.headers["x-request-id"] == "same-id"
        assert raw.parse().id == "chatcmpl-same-id"
    assert wait_until(lambda: gateway.meter.num_settle_calls == 2)
    assert wait_until(lambda: len(gateway.meter.settled) == 2)
    assert all(record_id.startswith("same-id/") for record_id in gateway.meter.settled)


def test_chat_tool_call_round_trip(client: openai.OpenAI, gateway: Gateway) -> None:
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "weather in Paris?"}],
        tools=[WEATHER_TOOL])
    call = completion.choices[0].message.tool_calls[0]
    assert completion.choices[0].finish_reason == "tool_calls"
    assert (call.function.name == "get_weather"
            and json.loads(call.function.arguments) == {"city": "Paris"})
    followup = client.chat.completions.create(model=MODEL, tools=[WEATHER_TOOL], messages=[
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
    assert followup.choices[0].message.content == "tok " * 8
    sent = gateway.upstreams[0].state.bodies[-1]["messages"]
    assert sent[1]["tool_calls"][0]["id"] == call.id and sent[2]["tool_call_id"] == call.id


def test_chat_stream_tool_call_arrives_in_pieces(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER_TOOL],
        stream=True))
    pieces = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert pieces[0].id == "call_mock0" and pieces[0].function.name == "get_weather"
    assert json.loads("".join(p.function.arguments or "" for p in pieces)) == {"city": "Paris"}


def test_completions_non_stream_and_stream(client: openai.OpenAI) -> None:
    completion = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=5)
    assert (completion.choices[0].text == "tok " * 5
            and completion.choices[0].finish_reason == "length")
    chunks = list(client.completions.create(model=MODEL, prompt="Once", max_tokens=20, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "tok " * 8


def test_responses_api_non_stream(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="hi", instructions="be brief")
    assert response.output_text == "tok " * 8
    assert response.status == "completed" and response.usage.output_tokens == 8


def test_responses_api_stream_event_sequence(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=MODEL, input="hi", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "tok " * 8
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == "tok " * 8


def test_responses_api_function_call_and_its_output(client: openai.OpenAI,
                                                    gateway: Gateway) -> None:
    tool = {"type": "function", "name": "get_weather",
            "parameters": WEATHER_TOOL["function"]["parameters"]}
    response = client.responses.create(model=MODEL, input="weather?", tools=[tool])
    call = response.output[0]
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    events = list(client.responses.create(model=MODEL, input="weather?", tools=[tool], stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(done[0].arguments) == {"city": "Paris"}
    followup = client.responses.create(model=MODEL, tools=[tool], input=[
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert followup.output_text == "tok " * 8
    assert gateway.upstreams[0].state.bodies[-1]["messages"][-1] == {
        "role": "tool", "content": "sunny", "tool_call_id": call.call_id}


def test_models_list_has_context_length_and_prices(client: openai.OpenAI) -> None:
    models = client.models.list()
    entry = models.data[0].model_dump()
    assert entry["id"] == MODEL and entry["owned_by"] == "aigw"
    assert entry["context_length"] == 4096
    assert entry["pricing"]["output_per_token"] == 2e-6


def test_an_unknown_model_says_where_the_model_names_are(client: openai.OpenAI) -> None:
    """A user who guessed a model name ("gpt-4o") is told where the real names are listed."""
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert missing.value.code == "model_not_found"
    assert "GET /v1/models" in missing.value.message
    assert MODEL in [model.id for model in client.models.list().data]
