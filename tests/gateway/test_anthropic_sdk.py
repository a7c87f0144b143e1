"""The official anthropic SDK, unchanged, against the gateway over real sockets."""

from __future__ import annotations

from types import SimpleNamespace

import anthropic
import httpx
import pytest

from bench.mock_upstream import MockConfig
from gateway.backends.openai_compat import OpenAICompatBackend
from gateway.dialects.anthropic_messages import AnthropicMessages
from gateway.request.canonical import estimate_prompt_tokens
from gateway.settings import GatewaySettings
from gateway.upstream.transport import MockResponse, MockTransport, UpstreamRequest
from tests.gateway.conftest import MODEL, Gateway, GatewayFactory

TOOL = {"name": "get_weather", "description": "Weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def _client(gateway: Gateway, prefix: str = "/anthropic") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.url + prefix, api_key="unused", max_retries=0)


@pytest.mark.parametrize("prefix", ["/anthropic", ""])
def test_messages_on_both_paths(gateway: Gateway, prefix: str) -> None:
    message = _client(gateway, prefix).messages.create(
        model=MODEL, max_tokens=100, system="be brief",
        messages=[{"role": "user", "content": "hello"}])
    assert message.content[0].text == "tok " * 8
    assert message.stop_reason == "end_turn"
    assert message.usage.output_tokens == 8


def test_usage_splits_cached_from_uncached_input(make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(configs=[MockConfig(num_cached_tokens=32)])
    message = _client(gateway).messages.create(
        model=MODEL, max_tokens=100,
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "x" * 40, "cache_control": {"type": "ephemeral"}}]}])
    assert message.usage.cache_read_input_tokens == 32
    assert message.usage.input_tokens == 10  # prompt 42 tokens, 32 of them read from the cache


def test_streaming_text_and_final_usage(make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(configs=[MockConfig(num_cached_tokens=4)])
    with _client(gateway).messages.stream(model=MODEL, max_tokens=3,
                                          messages=[{"role": "user", "content": "hi"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "tok " * 3
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 3 and final.usage.cache_read_input_tokens == 4


def test_tool_use_then_tool_result(gateway: Gateway) -> None:
    client = _client(gateway)
    first = client.messages.create(model=MODEL, max_tokens=100, tools=[TOOL],
                                   messages=[{"role": "user", "content": "weather in Paris?"}])
    tool_use = first.content[0]
    assert first.stop_reason == "tool_use"
    assert tool_use.type == "tool_use" and tool_use.input == {"city": "Paris"}
    second = client.messages.create(model=MODEL, max_tokens=100, tools=[TOOL], messages=[
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": [tool_use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id,
                                      "content": "sunny"}]}])
    assert second.content[0].text == "tok " * 8
    sent = gateway.upstreams[0].state.bodies[-1]["messages"]
    assert sent[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert sent[2] == {"role": "tool", "content": "sunny", "tool_call_id": tool_use.id}


def test_streamed_tool_use_accumulates_json_input(gateway: Gateway) -> None:
    with _client(gateway).messages.stream(model=MODEL, max_tokens=100, tools=[TOOL],
                                          messages=[{"role": "user",
                                                     "content": "weather?"}]) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "tool_use" and final.content[0].input == {"city": "Paris"}
    assert final.stop_reason == "tool_use"


@pytest.mark.parametrize("prefix", ["/anthropic", ""])
def test_count_tokens_renders_the_prompt_without_calling_the_replica(gateway: Gateway, prefix: str
                                                                     ) -> None:
    """A replica model is counted with the replica's own template and tokenizer (the exact count
    against a real replica's usage is tests/gateway/test_replica_e2e.py)."""
    client = _client(gateway, prefix)
    messages = [{"role": "user", "content": "hello " * 50}]
    plain = client.messages.count_tokens(model=MODEL, messages=messages).input_tokens  # type: ignore[arg-type]
    with_tools = client.messages.count_tokens(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                              system="be brief", tools=[TOOL]).input_tokens  # type: ignore[list-item]
    assert 50 <= plain < with_tools
    assert not gateway.upstreams[0].state.request_ids  # counted here: no upstream call


def test_count_tokens_of_an_upstream_without_a_tokenizer_is_the_documented_estimate() -> None:
    backend = OpenAICompatBackend(MockTransport(_never_called), GatewaySettings())
    body = {"model": MODEL, "system": "be brief", "tools": [TOOL],
            "messages": [{"role": "user", "content": "hello " * 50}]}
    canonical = AnthropicMessages().parse_count_tokens(body, "r")
    endpoint = SimpleNamespace(model=SimpleNamespace(tokenizer=None))
    assert backend.count_prompt_tokens(canonical, endpoint) == estimate_prompt_tokens(canonical)  # type: ignore[arg-type]


async def _never_called(request: UpstreamRequest) -> MockResponse:
    raise AssertionError("counting tokens must not call the upstream")


def test_count_tokens_answers_bad_input_in_anthropics_envelope(gateway: Gateway) -> None:
    client = _client(gateway)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="no-such-model",
                                     messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.count_tokens(model=MODEL, messages=[])
    assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    raw = httpx.post(gateway.url + "/v1/messages/count_tokens", content=b"{")
    assert raw.status_code == 400 and raw.json()["type"] == "error"


def test_models_at_the_root_answer_the_anthropic_sdk_in_its_form(gateway: Gateway) -> None:
    """The Anthropic SDK with base_url at the root reads /v1/models (shared with OpenAI): its
    `anthropic-version` header gets Anthropic's form; an OpenAI client still gets OpenAI's."""
    client = _client(gateway, "")
    (model,) = client.models.list().data
    assert model.type == "model" and model.id == MODEL and model.display_name == MODEL
    assert model.created_at.year == 1970
    assert client.models.retrieve(MODEL).type == "model"
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.body["error"]["code"] == "model_not_found"  # type: ignore[index]
    assert httpx.get(gateway.url + "/v1/models").json()["object"] == "list"


def test_error_types_follow_anthropics_table() -> None:
    """Another 4xx is an invalid_request_error and a gateway timeout a timeout_error, as
    Anthropic documents; api_error stays for the other 5xx."""
    types = {status: AnthropicMessages().error_body(status, "c", "m")["error"]["type"]
             for status in (405, 409, 502, 504)}
    assert types == {405: "invalid_request_error", 409: "invalid_request_error",
                     502: "api_error", 504: "timeout_error"}


def test_errors_under_v1_messages_answer_in_anthropics_envelope(gateway: Gateway) -> None:
    """count_tokens at the root and the batches the SDK may call are Anthropic routes too."""
    wrong_method = httpx.get(gateway.url + "/v1/messages/count_tokens")
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as missing:
        _client(gateway, "").messages.batches.list()
    assert missing.value.body["type"] == "error"  # type: ignore[index]


def test_prefill_asks_the_replica_to_continue_the_assistant_text(gateway: Gateway) -> None:
    """A last assistant message with text is Anthropic's prefill: the replica continues it
    (continue_final_message) and count_tokens counts the same open turn; a conversation ending
    in a user turn, or in an assistant tool_use, asks for a new turn."""
    client = _client(gateway)
    prefill = [{"role": "user", "content": "Name a color"},
               {"role": "assistant", "content": [{"type": "text", "text": "The color is"}]}]
    client.messages.create(model=MODEL, max_tokens=4, messages=prefill)  # type: ignore[arg-type]
    assert gateway.upstreams[0].state.bodies[-1]["continue_final_message"] is True
    open_turn = client.messages.count_tokens(model=MODEL, messages=prefill).input_tokens  # type: ignore[arg-type]
    new_turn = client.messages.count_tokens(model=MODEL, messages=prefill[:1]).input_tokens  # type: ignore[arg-type]
    assert open_turn == new_turn + 3  # + "The color is" (3 tokens), no end of turn, no new header
    tool_use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
    for messages in ([prefill[0]], [prefill[0], {"role": "assistant", "content": [tool_use]}],
                     [prefill[0], {"role": "assistant", "content": " "}]):
        client.messages.create(model=MODEL, max_tokens=4, tools=[TOOL],  # type: ignore[list-item]
                               messages=messages)  # type: ignore[arg-type]
        assert "continue_final_message" not in gateway.upstreams[0].state.bodies[-1]


def test_output_config_format_is_sent_as_a_json_schema_response_format(gateway: Gateway) -> None:
    """Anthropic structured output (what `messages.parse(output_format=...)` sends) reaches the
    replica as chat's response_format, which constrains decoding; a format we cannot honour is
    a 400 rather than free text."""
    client = _client(gateway)
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                           output_config={"format": {"type": "json_schema", "schema": schema}})
    assert gateway.upstreams[0].state.bodies[-1]["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                           extra_body={"output_format": {"type": "json_schema", "schema": schema}})
    assert gateway.upstreams[0].state.bodies[-1]["response_format"]["type"] == "json_schema"
    for bad in ({"type": "json_object"}, {"type": "json_schema"}):
        with pytest.raises(anthropic.BadRequestError, match="output_config.format"):
            client.messages.create(model=MODEL, max_tokens=4, output_config={"format": bad},  # type: ignore[typeddict-item]
                                   messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError, match="prefill"):  # JSON would start over
        client.messages.create(model=MODEL, max_tokens=4,
                               output_config={"format": {"type": "json_schema", "schema": schema}},
                               messages=[{"role": "user", "content": "hi"},
                                         {"role": "assistant", "content": '{"name":'}])


def test_disable_parallel_tool_use_is_sent_as_parallel_tool_calls_false(gateway: Gateway) -> None:
    client = _client(gateway)
    for disable, expected in ((True, False), (None, None)):
        choice: dict[str, object] = {"type": "any"}
        if disable is not None:
            choice["disable_parallel_tool_use"] = disable
        client.messages.create(model=MODEL, max_tokens=4, tools=[TOOL],  # type: ignore[list-item]
                               tool_choice=choice,  # type: ignore[arg-type]
                               messages=[{"role": "user", "content": "weather?"}])
        assert gateway.upstreams[0].state.bodies[-1].get("parallel_tool_calls") == expected


def test_count_tokens_refuses_what_the_replica_refuses_with_its_plain_message(
        gateway: Gateway) -> None:
    """Counting renders the replica's body with the replica's own validation: its refusal is the
    message a Messages request gets, not a pydantic dump of the upstream body."""
    with pytest.raises(anthropic.BadRequestError) as refused:
        _client(gateway).messages.count_tokens(model=MODEL, tool_choice={"type": "any"},
                                               messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body["error"]["message"] == "tool_choice requires tools"  # type: ignore[index]
