"""Priority classes end to end: OpenAI's service_tier (and the project's default class) through
the gateway, with the real openai SDK, to a real replica app (the fake engine, which records the
class its engine request got), and the class used echoed in the answer. Bad values are a 400 in
the dialect's error format naming service_tier."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from auth.principal import AuthError, Principal, Scope
from engine.server import ReplicaServerSettings
from engine.server import create_app as create_replica_app
from gateway.dialects.anthropic_messages import AnthropicMessages
from gateway.dialects.openai_chat import OpenAIChat
from gateway.dialects.openai_completions import OpenAICompletions
from gateway.dialects.openai_responses import OpenAIResponses
from gateway.dialects.validate import InvalidParam
from tests.engine.server.fakes import FakeEngine
from tests.gateway.conftest import Gateway, GatewayFactory, LoopThread, start_app

USER = [{"role": "user", "content": "hi"}]


class TwoProjects:
    """Key 'batchy' is project batchy's (default class flex), 'a' project a's (no default)."""

    async def authenticate(self, credential: str | None) -> Principal:
        if credential in ("a", "batchy"):
            return Principal(credential, f"key-{credential}", frozenset({Scope.INVOKE.value}))
        raise AuthError(401, "invalid_api_key", "unknown key")


@pytest.fixture
def replica(loop_thread: LoopThread) -> Iterator[tuple[FakeEngine, str]]:
    engine = FakeEngine()
    runner, url = loop_thread.run(start_app(create_replica_app(engine, ReplicaServerSettings())))
    yield engine, url
    loop_thread.run(runner.cleanup())


@pytest.fixture
def served(make_gateway: GatewayFactory,
           replica: tuple[FakeEngine, str]) -> tuple[Gateway, FakeEngine]:
    engine, url = replica
    models = [{"name": "m", "upstream_model": str(engine.model_config.model_id),
               "backend": "replica", "endpoints": [url]}]
    return make_gateway(models=models, authenticator=TwoProjects(),
                        project_service_tiers={"batchy": "flex"}), engine


def _client(gateway: Gateway, key: str = "a") -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=30)


@pytest.mark.parametrize(("asked", "used", "priority"), [
    (None, "default", 0), ("auto", "default", 0), ("default", "default", 0),
    ("priority", "priority", -1), ("flex", "flex", 1), ("fast", "priority", -1)])
def test_service_tier_reaches_the_engine_and_is_echoed(
        served: tuple[Gateway, FakeEngine], asked: str | None, used: str, priority: int) -> None:
    gateway, engine = served
    client = _client(gateway)
    extra: dict[str, Any] = {} if asked is None else {"service_tier": asked}
    chat = client.chat.completions.create(model="m", messages=USER, max_tokens=4,  # type: ignore[arg-type]
                                          extra_body=extra)
    assert chat.service_tier == used
    chunks = list(client.chat.completions.create(
        model="m", messages=USER, max_tokens=4, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}, extra_body=extra))
    assert {chunk.service_tier for chunk in chunks} == {used}
    answer = client.responses.create(model="m", input="hi", max_output_tokens=16, store=False,
                                     extra_body=extra)
    assert answer.service_tier == used
    client.completions.create(model="m", prompt="hi", max_tokens=4, extra_body=extra)
    assert [call.priority for call in engine.calls] == [priority] * 4


def test_the_projects_default_class_applies_when_none_is_asked(
        served: tuple[Gateway, FakeEngine]) -> None:
    gateway, engine = served
    client = _client(gateway, key="batchy")
    assert client.chat.completions.create(model="m", messages=USER,  # type: ignore[arg-type]
                                          max_tokens=4).service_tier == "flex"
    assert client.chat.completions.create(model="m", messages=USER, max_tokens=4,  # type: ignore[arg-type]
                                          service_tier="auto").service_tier == "flex"
    assert client.chat.completions.create(model="m", messages=USER, max_tokens=4,  # type: ignore[arg-type]
                                          service_tier="priority").service_tier == "priority"
    messages = anthropic.Anthropic(base_url=gateway.url, api_key="batchy", max_retries=0)
    messages.messages.create(model="m", max_tokens=4, messages=USER)  # type: ignore[arg-type]
    messages.messages.create(model="m", max_tokens=4, messages=USER,  # type: ignore[arg-type]
                             service_tier="standard_only")
    # the replica's own `priority` field is the gateway's to set: a client's is not forwarded
    client.chat.completions.create(model="m", messages=USER, max_tokens=4,  # type: ignore[arg-type]
                                   extra_body={"priority": -1000})
    assert [call.priority for call in engine.calls] == [1, 1, -1, 1, 0, 1]


def test_a_bad_service_tier_is_a_400_naming_it(served: tuple[Gateway, FakeEngine]) -> None:
    gateway, engine = served
    client = _client(gateway)
    for call in (lambda: client.chat.completions.create(
                     model="m", messages=USER, max_tokens=4,  # type: ignore[arg-type]
                     extra_body={"service_tier": "urgent"}),
                 lambda: client.responses.create(model="m", input="hi",
                                                 extra_body={"service_tier": 1})):
        with pytest.raises(openai.BadRequestError) as raised:
            call()
        assert raised.value.status_code == 400
        assert raised.value.body["param"] == "service_tier"  # type: ignore[index]
        assert raised.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    messages = anthropic.Anthropic(base_url=gateway.url, api_key="a", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as refused:
        messages.messages.create(model="m", max_tokens=4, messages=USER,  # type: ignore[arg-type]
                                 extra_body={"service_tier": "priority"})
    assert "service_tier" in str(refused.value)
    assert not engine.calls


def test_every_dialect_parses_the_class() -> None:
    chat = OpenAIChat().parse({"model": "m", "messages": USER, "service_tier": "flex"}, "r")
    text = OpenAICompletions().parse({"model": "m", "prompt": "hi", "service_tier": "flex"}, "r")
    responses = OpenAIResponses().parse({"model": "m", "input": "hi", "service_tier": "flex"}, "r")
    assert chat.service_tier == text.service_tier == responses.service_tier == "flex"
    assert OpenAIChat().parse({"model": "m", "messages": USER, "service_tier": "scale"},
                              "r").service_tier == "default"  # reserved capacity: not offered
    body = {"model": "m", "max_tokens": 4, "messages": USER}
    assert AnthropicMessages().parse({**body, "service_tier": "auto"}, "r").service_tier is None
    with pytest.raises(InvalidParam) as raised:
        OpenAICompletions().parse({"model": "m", "prompt": "hi", "service_tier": []}, "r")
    assert raised.value.param == "service_tier"
