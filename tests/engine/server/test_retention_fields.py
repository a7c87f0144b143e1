"""The replica's KV retention fields reach the engine: OpenAI's prompt_cache_retention (through the
official SDK) and prompt_cache_key, our cache_retention_s / cache_retention_id; bad values are the
OpenAI error envelope's 400, never a 500."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.engine.server.fakes import FakeEngine

USER = [{"role": "user", "content": "Say hello"}]


def test_the_sdk_retention_fields_reach_the_engine(client: openai.OpenAI, fake_engine: FakeEngine,
                                                   model: str) -> None:
    client.chat.completions.create(model=model, messages=USER)  # type: ignore[arg-type]
    client.chat.completions.create(model=model, messages=USER, prompt_cache_retention="24h",  # type: ignore[arg-type]
                                   prompt_cache_key="agent-1")
    client.completions.create(model=model, prompt="hi", extra_body={
        "cache_retention_s": 90, "cache_retention_id": "s:abc"})
    plain, asked, ours = (call.retention for call in fake_engine.calls)
    assert plain == (0.0, None)
    assert asked[0] == 86_400.0 and asked[1] is not None and asked[1].startswith("key:")
    assert "agent-1" not in asked[1]  # a digest: bounded whatever the key's length
    assert ours == (90.0, "s:abc")


@pytest.mark.parametrize("fields", [{"cache_retention_s": -1}, {"cache_retention_s": "5m"},
                                    {"prompt_cache_retention": "forever"},
                                    {"cache_retention_id": "x" * 129}])
def test_bad_retention_fields_are_a_400(http: httpx.Client, model: str,
                                        fields: dict[str, object]) -> None:
    answer = http.post("/v1/chat/completions", json={"model": model, "messages": USER, **fields})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["type"] == "invalid_request_error"
