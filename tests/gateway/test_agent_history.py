"""Agent histories on the three chat-like routes: what a tool-calling loop sends back each turn.
A well-formed history reaches the upstream; a tool result that answers no call, a call without a
name, or a tool whose parameters schema is not of type object is a 400 naming the field, as
OpenAI and Anthropic answer them, and nothing is sent upstream or metered."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import pytest

from tests.gateway.conftest import MODEL, Gateway

SCHEMA = {"type": "object", "properties": {"cmd": {"type": "string"}}}
CHAT_TOOLS = [{"type": "function", "function": {"name": "sh", "parameters": SCHEMA}}]
SYSTEM = {"role": "system", "content": "You are an agent."}
USER = {"role": "user", "content": "list the files"}


def _call(call_id: str, name: str = "sh") -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": '{"cmd":"ls"}'}}


def _calls(*ids: str) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [_call(i) for i in ids]}


def _result(call_id: str, content: Any = "a.py") -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _chat(messages: list[dict[str, Any]], tools: Any = None) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "tools": tools or CHAT_TOOLS}


def _responses(items: list[dict[str, Any]], tools: Any = None) -> dict[str, Any]:
    return {"model": MODEL, "input": items,
            "tools": tools or [{"type": "function", "name": "sh", "parameters": SCHEMA}]}


def _fc(call_id: str, name: str = "sh") -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": "{}"}


def _fco(call_id: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": "a.py"}


def _messages(messages: list[dict[str, Any]], tools: Any = None) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 8, "system": [{"type": "text", "text": "agent",
                                                         "cache_control": {"type": "ephemeral"}}],
            "messages": messages, "tools": tools or [{"name": "sh", "input_schema": SCHEMA}]}


def _use(use_id: str, name: str = "sh") -> dict[str, Any]:
    return {"role": "assistant", "content": [{"type": "tool_use", "id": use_id, "name": name,
                                              "input": {"cmd": "ls"}}]}


def _tool_result(use_id: str, **extra: Any) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use_id,
                                         "content": "a.py", **extra}]}


GOOD = [
    ("/v1/chat/completions", _chat([SYSTEM, USER, _calls("c1", "c2"), _result("c1"),
                                    _result("c2", [{"type": "text", "text": "b.py"}]),
                                    {"role": "assistant", "content": "done"}, USER,
                                    _calls("c3"), _result("c3")]), ["c1", "c2", "c3"]),
    ("/v1/responses", _responses([{"role": "user", "content": "go"}, _fc("c1"), _fc("c2"),
                                  _fco("c2"), _fco("c1"), _fc("c3"), _fco("c3")]),
     ["c2", "c1", "c3"]),
    ("/anthropic/v1/messages", _messages([
        {"role": "user", "content": "go"}, _use("toolu_1"),
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "a.py"}],
                                      "is_error": True}, {"type": "text", "text": "go on"}]},
        _use("toolu_2"), _tool_result("toolu_2", cache_control={"type": "ephemeral"})]),
     ["toolu_1", "toolu_2"]),
]


@pytest.mark.parametrize(("path", "body", "result_ids"), GOOD, ids=[case[0] for case in GOOD])
def test_a_well_formed_agent_history_reaches_the_upstream(gateway: Gateway, path: str,
                                                          body: dict[str, Any],
                                                          result_ids: list[str]) -> None:
    response = httpx.post(gateway.url + path, json=body)
    assert response.status_code == 200, response.text
    sent = gateway.upstreams[0].state.bodies[-1]["messages"]
    assert [m["tool_call_id"] for m in sent if m["role"] == "tool"] == result_ids


BAD = [
    ("/v1/chat/completions", "tool_without_a_call", _chat([SYSTEM, USER, _result("c1")]),
     "messages[2].tool_call_id", "must follow an assistant message with tool calls"),
    ("/v1/chat/completions", "tool_first", _chat([_result("c1")]),
     "messages[0].tool_call_id", "must follow"),
    ("/v1/chat/completions", "tool_id_matches_nothing", _chat([USER, _calls("c1"), _result("c9")]),
     "messages[2].tool_call_id", "'c9' answers no tool call"),
    ("/v1/chat/completions", "tool_after_a_user_turn", _chat([USER, _calls("c1"), USER,
                                                              _result("c1")]),
     "messages[3].tool_call_id", "must follow"),
    ("/v1/chat/completions", "call_without_a_name",
     _chat([USER, {"role": "assistant", "tool_calls": [_call("c1", name="")]}, _result("c1")]),
     "messages[1].tool_calls[0].function.name", "must not be empty"),
    ("/v1/chat/completions", "parameters_of_type_string",
     _chat([USER], [{"type": "function", "function": {"name": "sh",
                                                      "parameters": {"type": "string"}}}]),
     "tools[0].function.parameters.type", "of type 'object'"),
    ("/v1/chat/completions", "parameters_not_an_object",
     _chat([USER], [{"type": "function", "function": {"name": "sh", "parameters": [SCHEMA]}}]),
     "tools[0].function.parameters", "expected an object"),
    ("/v1/responses", "output_without_a_call", _responses([{"role": "user", "content": "go"},
                                                           _fco("c1")]),
     "input[1].call_id", "must follow"),
    ("/v1/responses", "output_id_matches_nothing", _responses([_fc("c1"), _fco("c9")]),
     "input[1].call_id", "'c9' answers no tool call"),
    ("/v1/responses", "call_without_a_name", _responses([_fc("c1", name=""), _fco("c1")]),
     "input[0].name", "must not be empty"),
    ("/v1/responses", "parameters_of_type_array",
     _responses([{"role": "user", "content": "go"}],
                [{"type": "function", "name": "sh", "parameters": {"type": "array"}}]),
     "tools[0].parameters.type", "of type 'object'"),
    ("/anthropic/v1/messages", "result_without_a_use",
     _messages([{"role": "user", "content": "go"}, {"role": "assistant", "content": "ok"},
                _tool_result("toolu_1")]), None, "messages[2].content: a tool result must follow"),
    ("/anthropic/v1/messages", "result_first", _messages([_tool_result("toolu_1")]), None,
     "messages[0].content: a tool result must follow"),
    ("/anthropic/v1/messages", "result_id_matches_nothing",
     _messages([{"role": "user", "content": "go"}, _use("toolu_1"), _tool_result("toolu_9")]),
     None, "messages[2].content: tool result 'toolu_9' answers no tool call"),
    ("/anthropic/v1/messages", "use_without_a_name",
     _messages([{"role": "user", "content": "go"}, _use("toolu_1", name=""),
                _tool_result("toolu_1")]), None, "messages[1].content[0].name: must not be empty"),
    ("/anthropic/v1/messages", "input_schema_of_type_string",
     _messages([{"role": "user", "content": "go"}], [{"name": "sh",
                                                      "input_schema": {"type": "string"}}]),
     None,
     "tools[0].input_schema.type: a tool's parameters must be a JSON schema of type 'object'"),
]


@pytest.mark.parametrize(("path", "body", "param", "message"),
                         [case[0:1] + case[2:] for case in BAD], ids=[case[1] for case in BAD])
def test_an_invalid_agent_history_is_a_400_naming_the_field(gateway: Gateway, path: str,
                                                             body: dict[str, Any],
                                                             param: str | None,
                                                             message: str) -> None:
    response = httpx.post(gateway.url + path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"]
    if path.startswith("/anthropic"):
        assert response.json()["type"] == "error" and error["type"] == "invalid_request_error"
    else:
        assert error["param"] == param and error["type"] == "invalid_request_error"
    assert not gateway.upstreams[0].state.request_ids  # nothing reached the upstream
    assert not gateway.meter.settled  # and nothing was metered


def test_count_tokens_refuses_a_result_that_answers_no_call(gateway: Gateway) -> None:
    body = _messages([{"role": "user", "content": "go"}, _use("toolu_1"), _tool_result("toolu_9")])
    del body["max_tokens"]
    response = httpx.post(gateway.url + "/anthropic/v1/messages/count_tokens", json=body)
    assert response.status_code == 400
    assert "'toolu_9' answers no tool call" in response.json()["error"]["message"]


def test_a_tool_use_input_nested_deeper_than_json_can_be_written_is_a_400(gateway: Gateway) -> None:
    """The body is read up to 1024 levels, the call's arguments written up to 254 (orjson)."""
    nested: Any = 1
    for _ in range(300):
        nested = {"a": nested}
    body = _messages([{"role": "user", "content": "go"},
                      {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                                         "name": "sh", "input": nested}]},
                      _tool_result("toolu_1")])
    response = httpx.post(gateway.url + "/anthropic/v1/messages", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"] == (
        "messages[1].content[0].input: is nested too deeply (more than ~250 levels)")


def test_the_anthropic_sdk_tool_runner_completes_though_no_thread_is_stored(
        gateway: Gateway) -> None:
    """The SDK's tool runner sends each turn as `thread: continue` with the new messages only; a
    404 thread_not_found makes it send the whole conversation again (it was answered with the
    lone tool_result as the conversation, or, checked, a 400 that ended the loop)."""
    cities: list[str] = []

    @anthropic.beta_tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        cities.append(city)
        return "sunny"

    client = anthropic.Anthropic(base_url=gateway.url + "/anthropic", api_key="x", max_retries=0)
    replies = list(client.beta.messages.tool_runner(
        model=MODEL, max_tokens=16, tools=[get_weather],
        messages=[{"role": "user", "content": "Weather in Paris?"}]))
    assert [reply.stop_reason for reply in replies] == ["tool_use", "end_turn"]
    assert cities == ["Paris"]
    sent = gateway.upstreams[0].state.bodies[-1]["messages"]  # the whole conversation, again
    assert [m["role"] for m in sent] == ["user", "assistant", "tool"]
    assert len(gateway.upstreams[0].state.bodies) == 2  # the refused continue reached no upstream


def test_a_thread_to_continue_is_anthropics_404_thread_not_found(gateway: Gateway) -> None:
    body = {**_messages([_tool_result("toolu_1")]),
            "thread": {"type": "continue", "previous_message_id": "msg_1"}}
    response = httpx.post(gateway.url + "/anthropic/v1/messages", json=body)
    assert response.status_code == 404
    error = response.json()["error"]
    assert (error["type"] == "not_found_error"
            and error["details"] == {"error_code": "thread_not_found"})
    created = httpx.post(gateway.url + "/anthropic/v1/messages", json={
        **_messages([{"role": "user", "content": "go"}]), "thread": {"type": "create"}})
    assert created.status_code == 200  # nothing to store: answered as without a thread


@pytest.mark.parametrize("conversation", ["conv_1", {"id": "conv_1"}])
def test_a_stored_responses_conversation_is_refused_not_ignored(gateway: Gateway,
                                                                conversation: Any) -> None:
    """Its items would come before `input`: ignored, the model answered without them."""
    response = httpx.post(gateway.url + "/v1/responses", json={
        **_responses([_fco("c1")]), "input": "and now?", "conversation": conversation})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "conversation"
    assert not gateway.upstreams[0].state.request_ids
