"""Every body the gateway sends on its OpenAI routes validates against OpenAI's published OpenAPI
description (tests/contract/openai/, spec 2.3.0): what strict generated clients decode.

The gateway and its replicas: tests/contract/conftest.py."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.contract.conftest import ASK, FAILING, FAKE, WEATHER, post, sse
from tests.contract.openapi_schema import schema_errors

pytestmark = pytest.mark.slow

CHAT_TOOLS = [{"type": "function", "function": WEATHER}]
RESPONSES_TOOLS = [{"type": "function", **WEATHER}]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
          "additionalProperties": False}


def _check(found: list[str], label: str, schema: str, body: Any) -> None:
    found += [f"{label} ({schema}) {line}" for line in schema_errors(schema, body)]


def test_models_list_and_entry_match_the_spec(http: httpx.Client, served: tuple[str, str]) -> None:
    found: list[str] = []
    listed = http.get("/models").json()
    _check(found, "models", "ListModelsResponse", listed)
    _check(found, "model", "Model", http.get(f"/models/{served[1]}").json())
    assert {entry["id"] for entry in listed["data"]} >= {served[1], FAKE}
    assert not found, "\n".join(found)


def test_chat_completions_match_the_spec(http: httpx.Client, served: tuple[str, str]) -> None:
    model, found = served[1], []
    bodies = {
        "plain": {"model": model, "messages": ASK, "max_tokens": 4},
        "n=2 logprobs": {"model": model, "messages": ASK, "max_tokens": 3, "n": 2, "logprobs": True,
                         "top_logprobs": 2},
        "structured": {"model": model, "messages": ASK, "max_tokens": 6, "response_format": {
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}},
        "reasoning+tool": {"model": FAKE, "messages": ASK, "tools": CHAT_TOOLS,
                           "tool_choice": "required"},
    }
    for label, body in bodies.items():
        status, answer = post(http, "/chat/completions", body)
        assert status == 200, (label, answer)
        _check(found, label, "CreateChatCompletionResponse", answer)
    assert len(answer["choices"][0]["message"]["tool_calls"]) == 1  # the fake's scripted call
    assert not found, "\n".join(found)


def test_chat_chunks_and_the_usage_chunk_match_the_spec(http: httpx.Client,
                                                        served: tuple[str, str]) -> None:
    model, found = served[1], []
    usage = {"stream_options": {"include_usage": True}}
    streams = {
        "plain+logprobs": {"model": model, "messages": ASK, "max_tokens": 3, "logprobs": True,
                           "top_logprobs": 1, **usage},
        "n=2": {"model": model, "messages": ASK, "max_tokens": 2, "n": 2, **usage},
        "reasoning+tool": {"model": FAKE, "messages": ASK, "tools": CHAT_TOOLS, **usage},
    }
    for label, body in streams.items():
        chunks = sse(http, "/chat/completions", body)
        assert chunks[-1][1]["usage"] is not None and chunks[-1][1]["choices"] == []
        for index, (_, chunk) in enumerate(chunks):
            _check(found, f"{label} chunk {index}", "CreateChatCompletionStreamResponse", chunk)
    assert not found, "\n".join(found)


def test_legacy_completions_match_the_spec(http: httpx.Client, served: tuple[str, str]) -> None:
    model, found = served[1], []
    status, answer = post(http, "/completions", {"model": model, "prompt": ["Hi", "Yo"],
                                                  "max_tokens": 3, "logprobs": 2})
    assert status == 200, answer
    _check(found, "completion", "CreateCompletionResponse", answer)
    chunks = sse(http, "/completions", {"model": model, "prompt": "Hi", "max_tokens": 3,
                                         "stream_options": {"include_usage": True}})
    # The spec gives streamed chunks the completion's schema, whose finish_reason is never null;
    # OpenAI's live API (and so the gateway) sends null until a choice's last chunk.
    assert chunks[-1][1]["usage"] is not None
    for index, (_, chunk) in enumerate(chunks):
        choices = [dict(c, finish_reason=c["finish_reason"] or "stop") for c in chunk["choices"]]
        _check(found, f"chunk {index}", "CreateCompletionResponse", dict(chunk, choices=choices))
    assert [c["finish_reason"] for _, chunk in chunks for c in chunk["choices"]][-1] is not None
    assert not found, "\n".join(found)


def test_responses_and_their_stream_events_match_the_spec(http: httpx.Client,
                                                          served: tuple[str, str]) -> None:
    model, found = served[1], []
    bodies = {
        "plain": {"model": model, "input": "Say hi", "max_output_tokens": 4},
        "structured": {"model": model, "input": "A person", "max_output_tokens": 6, "text": {
            "format": {"type": "json_schema", "name": "person", "schema": PERSON}}},
        "reasoning+tool": {"model": FAKE, "input": "Weather in Paris?", "tools": RESPONSES_TOOLS,
                           "reasoning": {"effort": "low"}},
    }
    for label, body in bodies.items():
        status, answer = post(http, "/responses", body)
        assert status == 200, (label, answer)
        _check(found, label, "Response", answer)
    assert [item["type"] for item in answer["output"]] == ["reasoning", "function_call"]
    kinds = set()
    for label in ("plain", "reasoning+tool"):
        for index, (name, event) in enumerate(sse(http, "/responses", bodies[label])):
            assert name == event["type"]
            kinds.add(event["type"])
            _check(found, f"{label} event {index} {name}", "ResponseStreamEvent", event)
    assert {"response.created", "response.output_text.delta", "response.reasoning_text.delta",
            "response.function_call_arguments.delta", "response.completed"} <= kinds
    assert not found, "\n".join(found)


def test_error_bodies_match_the_spec(http: httpx.Client, served: tuple[str, str]) -> None:
    model, found = served[1], []
    too_long = "hello " * 40_000
    cases = [
        ("/chat/completions", {"model": "no-such-model", "messages": ASK}, 404),
        ("/chat/completions", {"model": model}, 400),
        ("/chat/completions", {"model": model, "messages": ASK, "temperature": "hot"}, 400),
        ("/chat/completions", {"model": model, "messages": [{"role": "user", "content": too_long}]},
         400),
        ("/completions", {"model": model, "prompt": 7}, 400),
        ("/responses", {"model": model, "input": 7}, 400),
        ("/responses", {"model": "no-such-model", "input": "x"}, 404),
    ]
    for path, body, status in cases:
        got, answer = post(http, path, body)
        assert got == status, (path, body, answer)
        _check(found, f"{path} {got}", "ErrorResponse", answer)
    answer = http.post("/chat/completions", content=b"{not json", headers={
        "content-type": "application/json"})
    assert answer.status_code == 400
    _check(found, "undecodable", "ErrorResponse", answer.json())
    missing = http.get("/models/no-such-model")
    assert missing.status_code == 404
    _check(found, "missing model", "ErrorResponse", missing.json())
    assert not found, "\n".join(found)


def test_mid_stream_errors_match_the_spec(http: httpx.Client) -> None:
    found: list[str] = []
    chat = sse(http, "/chat/completions", {"model": FAILING, "messages": ASK})
    assert "error" in chat[-1][1]
    _check(found, "chat stream error", "ErrorResponse", chat[-1][1])
    for index, (_, chunk) in enumerate(chat[:-1]):
        _check(found, f"chat chunk {index}", "CreateChatCompletionStreamResponse", chunk)
    events = sse(http, "/responses", {"model": FAILING, "input": "Say hi"})
    assert events[-1][0] == "error"
    for index, (name, event) in enumerate(events):
        _check(found, f"responses event {index} {name}", "ResponseStreamEvent", event)
    assert not found, "\n".join(found)
