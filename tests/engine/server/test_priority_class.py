"""The replica takes a request's scheduling class from `priority` (vLLM's int) or OpenAI's
`service_tier` and hands it to the engine (FakeEngine records it)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.engine.server.fakes import FakeEngine

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("extra", "priority"), [
    ({}, 0), ({"service_tier": "flex"}, 1), ({"service_tier": "priority"}, -1),
    ({"service_tier": "fast"}, -1), ({"service_tier": "auto"}, 0), ({"priority": 1}, 1),
    ({"priority": -1, "service_tier": "flex"}, -1),
])
def test_the_class_reaches_the_engine(client: openai.OpenAI, fake_engine: FakeEngine, model: str,
                                      extra: dict[str, object], priority: int) -> None:
    client.chat.completions.create(model=model, messages=USER, max_tokens=3,  # type: ignore[arg-type]
                                   extra_body=extra)
    client.completions.create(model=model, prompt="hi", max_tokens=3, extra_body=extra)
    assert [call.priority for call in fake_engine.calls] == [priority, priority]


@pytest.mark.parametrize("extra", [{"service_tier": "urgent"}, {"priority": "high"},
                                   {"priority": 10_000}])
def test_a_bad_class_is_a_400_naming_the_field(http: httpx.Client, fake_engine: FakeEngine,
                                               model: str, extra: dict[str, object]) -> None:
    response = http.post("/v1/chat/completions", json={"model": model, "messages": USER, **extra})
    assert response.status_code == 400
    assert next(iter(extra)) in response.json()["error"]["message"] + str(
        response.json()["error"].get("param"))
    assert not fake_engine.calls
