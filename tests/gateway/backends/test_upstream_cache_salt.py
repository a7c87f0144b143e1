"""An OpenAI-compatible upstream gets the tenant's `cache_salt` (vLLM's field: a shared vLLM then
keeps each project's prefix cache apart): a digest, one per project, never the project's name;
`send_cache_salt = false` (an upstream that refuses unknown fields) and
`share_cache_across_projects` leave it out."""

from __future__ import annotations

from typing import Any

import openai
import orjson
import pytest
from aiohttp import web

from auth.principal import AuthError, Principal, Scope
from tests.gateway.conftest import GatewayFactory, LoopThread, start_chat_upstream

ANSWER = {"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                       "finish_reason": "stop"}],
          "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


class TwoProjects:
    async def authenticate(self, credential: str | None) -> Principal:
        if credential in ("key-a1", "key-a2"):
            return Principal("acme-corp", credential, frozenset({Scope.INVOKE.value}))
        if credential == "key-b":
            return Principal("globex", "key-b", frozenset({Scope.INVOKE.value}))
        raise AuthError(401, "invalid_api_key", "unknown key")


@pytest.fixture
def recording_upstream(loop_thread: LoopThread) -> Any:
    bodies: list[dict[str, Any]] = []

    async def chat(request: web.Request) -> web.Response:
        bodies.append(orjson.loads(await request.read()))
        return web.json_response({**ANSWER, "model": bodies[-1]["model"]})

    runner, url = start_chat_upstream(loop_thread, chat)
    yield url, bodies
    loop_thread.run(runner.cleanup())


def test_each_project_reaches_the_upstream_under_its_own_salt_unless_switched_off(
        make_gateway: GatewayFactory, recording_upstream: Any) -> None:
    url, bodies = recording_upstream
    gateway = make_gateway(num_upstreams=0, configs=[], authenticator=TwoProjects(), models=[
        {"name": "salted", "backend": "openai", "endpoints": [url]},
        {"name": "strict", "backend": "openai", "endpoints": [url], "send_cache_salt": False},
        {"name": "shared", "backend": "openai", "endpoints": [url],
         "share_cache_across_projects": True}])

    def ask(key: str, model: str) -> dict[str, Any]:
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
        return bodies[-1]

    a1, a2, b = ask("key-a1", "salted"), ask("key-a2", "salted"), ask("key-b", "salted")
    assert a1["cache_salt"] == a2["cache_salt"] != b["cache_salt"]  # per project, stable
    assert len(a1["cache_salt"]) == 32 and "acme" not in a1["cache_salt"]
    assert "cache_salt" not in ask("key-a1", "strict")
    assert "cache_salt" not in ask("key-b", "shared")


class LongProjects:
    """Principals whose salt is over the replica's bound (a custom authenticator's project, or
    a JWT's long `sub` in a per-key salt)."""

    async def authenticate(self, credential: str | None) -> Principal:
        if credential is None or not credential.startswith("long-"):
            raise AuthError(401, "invalid_api_key", "unknown key")
        return Principal(credential * 60, credential, frozenset({Scope.INVOKE.value}))


def test_a_salt_over_the_replicas_bound_reaches_it_as_its_digest_one_per_tenant(
        make_gateway: GatewayFactory, loop_thread: LoopThread) -> None:
    """The replica refuses a cache_salt over MAX_CACHE_SALT_BYTES with a 400: the gateway sends
    a longer one as its digest, so the request is served and tenants stay apart."""
    from contracts.replica_protocol import MAX_CACHE_SALT_BYTES
    from engine.server import ReplicaServerSettings
    from engine.server import create_app as create_replica_app
    from tests.engine.server.fakes import FakeEngine
    from tests.gateway.conftest import start_app

    engine = FakeEngine()
    runner, url = loop_thread.run(start_app(create_replica_app(engine,
                                                               ReplicaServerSettings())))
    try:
        gateway = make_gateway(num_upstreams=0, configs=[], authenticator=LongProjects(), models=[
            {"name": "m", "upstream_model": str(engine.model_config.model_id),
             "backend": "replica", "endpoints": [url]}])
        for key in ("long-a", "long-a", "long-b"):
            client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)
            client.chat.completions.create(model="m",
                                           messages=[{"role": "user", "content": "hi"}])
    finally:
        loop_thread.run(runner.cleanup())
    a1, a2, b = (call.cache_salt or "" for call in engine.calls)
    assert a1 == a2 != b and all(len(s.encode()) <= MAX_CACHE_SALT_BYTES for s in (a1, b))
    assert "long-a" not in a1
