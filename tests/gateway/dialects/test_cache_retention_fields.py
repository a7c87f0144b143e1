"""The clients' prompt-cache retention fields parsed into the canonical request (Anthropic
cache_control ttl anywhere it may appear, OpenAI prompt_cache_retention / prompt_cache_options),
bad values refused with the param named, and the gateway's retention policy: clamped to its
maximum, a default only for a session seen before, one retention id per (project, session)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.dialects.anthropic_messages import AnthropicMessages
from gateway.dialects.openai_chat import OpenAIChat
from gateway.dialects.openai_completions import OpenAICompletions
from gateway.dialects.openai_responses import OpenAIResponses
from gateway.dialects.validate import InvalidParam
from gateway.request.canonical import CanonicalRequest
from gateway.request.retention import RetentionPolicy, RetentionSettings


def anthropic(**fields: Any) -> CanonicalRequest:
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
            **fields}
    return AnthropicMessages().parse(body, "r1")


def ephemeral(ttl: str | None = None) -> dict[str, str]:
    return {"type": "ephemeral"} if ttl is None else {"type": "ephemeral", "ttl": ttl}


@pytest.mark.parametrize(("fields", "expected"), [
    ({}, None),
    ({"cache_control": ephemeral()}, 300.0),
    ({"system": [{"type": "text", "text": "s", "cache_control": ephemeral("1h")}]}, 3600.0),
    ({"tools": [{"name": "t", "input_schema": {"type": "object"},
                 "cache_control": ephemeral("5m")}]},
     300.0),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a", "cache_control": ephemeral("5m")},
        {"type": "text", "text": "b", "cache_control": ephemeral("1h")}]}]}, 3600.0),
])
def test_anthropic_cache_control_ttl_becomes_the_longest_retention(
        fields: dict[str, Any], expected: float | None) -> None:
    assert anthropic(**fields).cache_retention_s == expected


@pytest.mark.parametrize(("fields", "param"), [
    ({"cache_control": {"type": "persistent"}}, "cache_control.type"),
    ({"cache_control": "5m"}, "cache_control"),
    ({"system": [{"type": "text", "text": "s", "cache_control": ephemeral("24h")}]},
     "system[0].cache_control.ttl"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a", "cache_control": ephemeral(3600)}]}]},  # type: ignore[arg-type]
     "messages[0].content[0].cache_control.ttl"),
])
def test_a_bad_cache_control_is_refused_naming_where(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidParam) as raised:
        anthropic(**fields)
    assert raised.value.param == param and raised.value.status == 400


@pytest.mark.parametrize(("fields", "expected"), [
    ({}, None),
    ({"prompt_cache_retention": "in_memory"}, 300.0),
    ({"prompt_cache_retention": "24h"}, 86_400.0),
    ({"prompt_cache_options": {"ttl": "30m"}}, 1800.0),
    ({"prompt_cache_retention": "in_memory", "prompt_cache_options": {"ttl": "30m"}}, 1800.0),
])
def test_openai_prompt_cache_retention_in_every_openai_dialect(fields: dict[str, Any],
                                                               expected: float | None) -> None:
    chat = OpenAIChat().parse({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                               **fields}, "r")
    text = OpenAICompletions().parse({"model": "m", "prompt": "hi", **fields}, "r")
    responses = OpenAIResponses().parse({"model": "m", "input": "hi", **fields}, "r")
    assert (chat.cache_retention_s == text.cache_retention_s == responses.cache_retention_s
            == expected)


@pytest.mark.parametrize(("fields", "param"), [
    ({"prompt_cache_retention": "forever"}, "prompt_cache_retention"),
    ({"prompt_cache_retention": 24}, "prompt_cache_retention"),
    ({"prompt_cache_options": {"ttl": "1h"}}, "prompt_cache_options.ttl"),
])
def test_a_bad_openai_retention_is_refused(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidParam) as raised:
        OpenAIChat().parse({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                            **fields}, "r")
    assert raised.value.param == param


def request(project: str = "p", key: str | None = None, session: str | None = None,
            asked: float | None = None) -> CanonicalRequest:
    canonical = CanonicalRequest("r", "m", project=project, prompt_cache_key=key,
                                 session_id=session)
    canonical.cache_retention_s = asked
    return canonical


def test_the_policy_clamps_what_is_asked_and_gives_a_repeating_session_its_default() -> None:
    policy = RetentionPolicy(RetentionSettings(max_s=600.0, session_s=120.0, max_sessions=2))
    assert policy.decide(request(asked=86_400.0)) == (600.0, None)  # no session: no id
    assert policy.decide(request(key="agent-1")) == (0.0, None)  # first turn: not yet repeating
    retain_s, first_id = policy.decide(request(key="agent-1"))
    assert retain_s == 120.0 and first_id is not None and first_id.startswith("s:")
    assert len(first_id) == 2 + 32  # a digest: the caller's text never reaches the replica
    _, asked_id = policy.decide(request(key="agent-1", asked=300.0))
    assert asked_id == first_id  # the same session, whatever its retention
    _, other_project = policy.decide(request(project="q", key="agent-1", asked=300.0))
    assert other_project != first_id
    assert policy.decide(request(session="s-9", asked=30.0))[0] == 30.0
    assert policy.num_sessions == 2  # bounded: the oldest forgotten
    assert policy.decide(request(key="agent-1")) == (0.0, None)  # forgotten, so first again


def test_a_zero_session_default_keeps_nothing_unasked() -> None:
    policy = RetentionPolicy(RetentionSettings(session_s=0.0))
    policy.decide(request(key="a"))
    assert policy.decide(request(key="a")) == (0.0, None)

