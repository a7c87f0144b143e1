"""Every body the gateway sends on its Anthropic routes parses as the official SDK's types in
pydantic's strict mode: every required field present, no value of the wrong type (no coercion).
The gateway and its replicas: tests/contract/conftest.py."""

from __future__ import annotations

from typing import Any

import anthropic.types as types
import httpx
import pydantic
import pytest

from tests.contract.conftest import ASK, FAILING, FAKE, WEATHER, post, sse

pytestmark = pytest.mark.slow

STREAM_EVENT: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(types.RawMessageStreamEvent)
THINKING = {"type": "enabled", "budget_tokens": 1024}


def _check(found: list[str], label: str, parse: Any, body: Any) -> None:
    try:
        parse(body, strict=True)
    except pydantic.ValidationError as error:
        found += [f"{label}: {'/'.join(map(str, e['loc']))}: {e['msg']} (got {e['input']!r:.80})"
                  for e in error.errors()]


def test_messages_and_stream_events_parse_strictly(http: httpx.Client,
                                                   served: tuple[str, str]) -> None:
    model, found = served[1], []
    bodies = {
        "plain": {"model": model, "max_tokens": 4, "system": "Be brief.", "messages": ASK},
        "thinking+tool": {"model": FAKE, "max_tokens": 256, "messages": ASK, "thinking": THINKING,
                          "tools": [{"name": WEATHER["name"], "description": WEATHER["description"],
                                     "input_schema": WEATHER["parameters"]}]},
    }
    for label, body in bodies.items():
        status, answer = post(http, "/messages", body)
        assert status == 200, (label, answer)
        _check(found, label, types.Message.model_validate, answer)
    assert [block["type"] for block in answer["content"]] == ["thinking", "tool_use"]
    kinds = set()
    for label, body in bodies.items():
        for index, (name, event) in enumerate(sse(http, "/messages", body)):
            assert name == event["type"]
            kinds.add(name)
            if name != "ping":
                _check(found, f"{label} event {index} {name}", STREAM_EVENT.validate_python, event)
    assert {"message_start", "content_block_start", "content_block_delta", "content_block_stop",
            "message_delta", "message_stop"} <= kinds
    assert not found, "\n".join(found)


def test_error_bodies_parse_strictly(http: httpx.Client, served: tuple[str, str]) -> None:
    model, found = served[1], []
    cases = [({"model": "no-such-model", "max_tokens": 4, "messages": ASK}, 404),
             ({"model": model, "messages": ASK}, 400),
             ({"model": model, "max_tokens": "4", "messages": ASK}, 400)]
    for body, status in cases:
        got, answer = post(http, "/messages", body)
        assert got == status, (body, answer)
        _check(found, f"error {got}", types.ErrorResponse.model_validate, answer)
    events = sse(http, "/messages", {"model": FAILING, "max_tokens": 16, "messages": ASK})
    assert events[-1][0] == "error"
    _check(found, "mid-stream error", types.ErrorResponse.model_validate, events[-1][1])
    assert not found, "\n".join(found)
