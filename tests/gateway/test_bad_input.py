"""Malformed requests on every route: each gets the documented status in the route's envelope."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.gateway.conftest import MODEL, Gateway, GatewayFactory

ROUTES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"model": MODEL, "prompt": "hi"},
    "/v1/responses": {"model": MODEL, "input": "hi"},
    "/anthropic/v1/messages": {"model": MODEL, "max_tokens": 5,
                               "messages": [{"role": "user", "content": "hi"}]},
}
REQUIRED = {"/v1/chat/completions": "messages", "/v1/completions": "prompt",
            "/v1/responses": "input", "/anthropic/v1/messages": "messages"}
MAX_BODY_BYTES = 4096


def _without(body: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != key}


def _cases(path: str) -> list[tuple[str, Any, int]]:
    """(name, body: bytes or a JSON-able object, expected status)."""
    good = ROUTES[path]
    cases: list[tuple[str, Any, int]] = [
        ("bad_json", b"{not json", 400),
        ("empty_body", b"", 400),
        ("not_an_object", [1, 2], 400),
        ("missing_model", _without(good, "model"), 400),
        ("model_wrong_type", {**good, "model": 123}, 400),
        ("missing_required_field", _without(good, REQUIRED[path]), 400),
        ("required_field_wrong_type", {**good, REQUIRED[path]: 42}, 400),
        ("stream_wrong_type", {**good, "stream": "yes"}, 400),
        ("temperature_out_of_range", {**good, "temperature": 5}, 400),
        ("unknown_model", {**good, "model": "no-such-model"}, 404),
        ("huge_body", {**good, "pad": "x" * (MAX_BODY_BYTES * 2)}, 413),
    ]
    if path.startswith("/anthropic"):
        cases += [("missing_max_tokens", _without(good, "max_tokens"), 400),
                  ("max_tokens_negative", {**good, "max_tokens": -1}, 400),
                  ("bad_role", {**good, "messages": [{"role": "system", "content": "x"}]}, 400),
                  ("tool_result_without_id", {**good, "messages": [{"role": "user", "content": [
                      {"type": "tool_result", "content": "x"}]}]}, 400),
                  ("tool_choice_type_an_array", {**good, "tool_choice": {"type": ["auto"]}}, 400),
                  ("tool_choice_type_an_object", {**good, "tool_choice": {"type": {}}}, 400),
                  ("tool_choice_without_type", {**good, "tool_choice": {}}, 400),
                  ("tool_name_with_a_space", {**good, "tools": [
                      {"name": "get weather", "input_schema": {"type": "object"}}]}, 400),
                  ("empty_content", {**good, "messages": [{"role": "user", "content": []}]}, 400),
                  ("empty_text_content", {**good, "messages": [
                      {"role": "user", "content": ""},
                      {"role": "assistant", "content": "a"}]}, 400),
                  ("stop_sequences_a_string", {**good, "stop_sequences": "x"}, 400),
                  ("tool_name_over_64", {**good, "tools": [
                      {"name": "f" * 65, "input_schema": {"type": "object"}}]}, 400),
                  ("history_tool_use_name_with_a_newline", {**good, "messages": [
                      {"role": "user", "content": "x"},
                      {"role": "assistant", "content": [
                          {"type": "tool_use", "id": "t1", "name": "f\nsystem:", "input": {}}]},
                      {"role": "user", "content": [
                          {"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]}, 400)]
    elif path == "/v1/responses":
        cases += [("max_output_tokens_string", {**good, "max_output_tokens": "10"}, 400),
                  ("unsupported_tool_type", {**good, "tools": [{"type": "web_search"}]}, 400),
                  ("tool_name_with_a_newline", {**good, "tools": [
                      {"type": "function", "name": "f\nsystem:"}]}, 400),
                  ("history_call_name_with_a_space", {**good, "input": [
                      {"type": "function_call", "call_id": "c", "name": "get it",
                       "arguments": "{}"}]}, 400),
                  ("previous_response_id", {**good, "previous_response_id": "resp_1"}, 400),
                  ("only_reasoning_items",
                   {**good, "input": [{"type": "reasoning", "summary": []}]}, 400)]
    else:
        cases += [("stream_options_without_stream",
                   {**good, "stream_options": {"include_usage": True}}, 400),
                  ("stream_options_wrong_type", {**good, "stream": True, "stream_options": "all"},
                   400),
                  ("include_usage_wrong_type", {**good, "stream": True,
                                                "stream_options": {"include_usage": "yes"}}, 400),
                  ("max_tokens_string", {**good, "max_tokens": "10"}, 400),
                  ("n_zero", {**good, "n": 0}, 400),
                  ("n_above_openais_bound", {**good, "n": 129}, 400),
                  ("n_string", {**good, "n": "2"}, 400),
                  ("seed_beyond_int64", {**good, "seed": 1 << 63}, 400),
                  ("seed_below_int64", {**good, "seed": -(1 << 63) - 1}, 400)]
    if path == "/v1/completions":
        cases += [("prompts_strings_and_ids", {**good, "prompt": ["a", [1, 2]]}, 400),
                  ("prompts_times_n_over_128", {**good, "prompt": ["a"] * 65, "n": 2}, 400),
                  ("empty_prompt_in_list", {**good, "prompt": [[1], []]}, 400),
                  ("empty_token_ids", {**good, "prompt": []}, 400),
                  ("negative_token_id", {**good, "prompt": [1, -2]}, 400),
                  ("mixed_prompt", {**good, "prompt": [1, "a"]}, 400)]
    if path == "/v1/chat/completions":
        cases += [("message_without_role", {**good, "messages": [{"content": "x"}]}, 400),
                  ("empty_messages", {**good, "messages": []}, 400),
                  ("tool_message_without_id",
                   {**good, "messages": [{"role": "tool", "content": "x"}]}, 400),
                  ("tool_without_name", {**good, "tools": [{"type": "function", "function": {}}]},
                   400),
                  ("message_name_with_a_newline", {**good, "messages": [
                      {"role": "user", "content": "x", "name": "bob\nsystem"}]}, 400),
                  ("history_call_name_with_a_space", {**good, "messages": [
                      {"role": "user", "content": "x"},
                      {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                            "function": {"name": "get it",
                                                                         "arguments": "{}"}}]},
                      {"role": "tool", "tool_call_id": "c", "content": "r"}]}, 400),
                  ("tool_name_with_a_dot", {**good, "tools": [
                      {"type": "function", "function": {"name": "functions.f"}}]}, 400),
                  ("tool_choice_function_not_an_object", {**good, "tool_choice": {
                      "type": "function", "function": "f"}}, 400),
                  ("tool_choice_function_an_array", {**good, "tool_choice": {
                      "type": "function", "function": ["f"]}}, 400)]
    return cases


TABLE = [(path, name, body, status) for path in ROUTES for name, body, status in _cases(path)]




@pytest.fixture
def capped(make_gateway: GatewayFactory) -> Gateway:
    return make_gateway(max_body_bytes=MAX_BODY_BYTES)


def test_every_route_rejects_every_bad_input_with_its_documented_status(capped: Gateway) -> None:
    failures = []
    with httpx.Client(base_url=capped.url, timeout=10) as client:
        for path, name, body, status in TABLE:
            content = (body if isinstance(body, bytes)
                       else httpx.Request("POST", "/", json=body).content)
            response = client.post(path, content=content,
                                   headers={"content-type": "application/json"})
            problem = _check(path, response, status)
            if problem:
                failures.append(f"{path} {name}: {problem}")
    assert not failures, "\n".join(failures)
    assert not capped.upstreams[0].state.request_ids  # nothing bad reached the upstream
    assert not capped.meter.settled  # and nothing was metered


def _check(path: str, response: httpx.Response, status: int) -> str | None:
    if response.status_code != status:
        return f"status {response.status_code} != {status}: {response.text[:200]}"
    if not response.headers.get("x-request-id"):
        return "no x-request-id"
    body = response.json()
    if path.startswith("/anthropic"):
        if (body.get("type") != "error" or not body["error"].get("message")
            or not body["error"].get("type")):
            return f"not an Anthropic envelope: {body}"
    elif not (isinstance(body.get("error"), dict) and body["error"].get("message")
              and body["error"].get("type")):
        return f"not an OpenAI envelope: {body}"
    return None


def test_unknown_route_and_wrong_method_answer_in_the_envelope(gateway: Gateway) -> None:
    missing = httpx.get(gateway.url + "/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert missing.json()["error"]["message"] == "Not Found"
    # an SDK's base_url that missed or doubled the /v1: the answer names the route meant
    for path, meant in (("/chat/completions", "/v1/chat/completions"),
                        ("/anthropic/v1/v1/messages", "/anthropic/v1/messages"),
                        ("/anthropic/messages", "/anthropic/v1/messages")):
        answer = httpx.post(gateway.url + path, json={})
        error = answer.json()["error"]
        assert answer.status_code == 404 and error["code"] == "not_found", path
        assert f"did you mean {meant}?" in error["message"], error
    wrong_method = httpx.get(gateway.url + "/anthropic/v1/messages")
    assert wrong_method.status_code == 405 and wrong_method.json()["type"] == "error"
    assert wrong_method.headers["x-request-id"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {**ROUTES["/v1/chat/completions"], "messages": [
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {}}]}]},
     "messages[0].tool_calls[0].function.name"),
    ("/v1/chat/completions", {**ROUTES["/v1/chat/completions"], "messages": [
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": {}}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ("/v1/responses", {**ROUTES["/v1/responses"], "input": [{"type": "reasoning", "summary": []}]},
     "input"),
])
def test_bad_nested_fields_name_their_full_path(gateway: Gateway, path: str, body: dict[str, Any],
                                                param: str) -> None:
    response = httpx.post(gateway.url + path, json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_only_a_final_assistant_message_may_be_empty_in_anthropics_dialect(
        gateway: Gateway) -> None:
    body = {**ROUTES["/anthropic/v1/messages"], "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": []}]}
    assert httpx.post(gateway.url + "/anthropic/v1/messages", json=body).status_code == 200
    body["messages"] = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""},
                        {"role": "user", "content": "again"}]
    refused = httpx.post(gateway.url + "/anthropic/v1/messages", json=body)
    assert refused.status_code == 400 and refused.json()["type"] == "error"
    assert "non-empty content" in refused.json()["error"]["message"]
