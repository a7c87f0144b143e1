"""What the router gets to see: the end user (OpenAI `user`, Anthropic metadata.user_id), the
`x-session-id` header, and the routing decision explained back when `x-aigw-debug: 1` asks for
it."""

from __future__ import annotations

from collections.abc import Sequence

import httpx

from gateway.fleet.endpoints import Endpoint
from gateway.request.canonical import CanonicalRequest
from gateway.routing.base import Decision, LeastOutstandingRouter
from tests.gateway.conftest import MODEL, GatewayFactory


class RecordingRouter(LeastOutstandingRouter):
    def __init__(self) -> None:
        self.seen: list[CanonicalRequest] = []

    def pick(self, request: CanonicalRequest, endpoints: Sequence[Endpoint]) -> Decision:
        self.seen.append(request)
        return super().pick(request, endpoints)

    def explain(self, request_id: str) -> str | None:
        return f"explained {request_id}"


def _gateway_with(make_gateway: GatewayFactory, router: RecordingRouter):  # type: ignore[no-untyped-def]
    gateway = make_gateway()
    from gateway.web.keys import PIPELINE

    pipeline = gateway.app[PIPELINE]
    pipeline.router = router
    return gateway


def test_user_and_session_reach_the_router_from_every_dialect(make_gateway: GatewayFactory) -> None:
    router = RecordingRouter()
    gateway = _gateway_with(make_gateway, router)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "user": "alice"}
    assert httpx.post(gateway.url + "/v1/chat/completions", json=chat,
                      headers={"x-session-id": "s-1"}).status_code == 200
    anthropic = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                 "metadata": {"user_id": "bob"}}
    assert httpx.post(gateway.url + "/v1/messages", json=anthropic).status_code == 200
    responses = {"model": MODEL, "input": "hi", "user": "carol"}
    assert httpx.post(gateway.url + "/v1/responses", json=responses).status_code == 200
    seen = [(r.user, r.session_id) for r in router.seen]
    assert seen[:2] == [("alice", "s-1"), ("bob", None)]
    # a stored response is its conversation's session unless the client names one (the next
    # turn's previous_response_id continues it: gateway/responses_store/conversation.py)
    assert seen[2][0] == "carol" and str(seen[2][1]).startswith("resp_")


def test_prompt_cache_key_reaches_the_router_from_the_openai_sdk(
        make_gateway: GatewayFactory) -> None:
    import openai

    router = RecordingRouter()
    gateway = _gateway_with(make_gateway, router)
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                   prompt_cache_key="conv-7", user="alice",
                                   extra_headers={"x-session-id": "s-1"})
    client.responses.create(model=MODEL, input="hi", prompt_cache_key="conv-8")
    client.completions.create(model=MODEL, prompt="hi", extra_body={"prompt_cache_key": "conv-9"})
    assert [(r.prompt_cache_key, r.session_id, r.user) for r in router.seen] == [
        ("conv-7", "s-1", "alice"), ("conv-8", None, None), ("conv-9", None, None)]
    bad = httpx.post(gateway.url + "/v1/chat/completions",
                     json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                           "prompt_cache_key": 7})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_cache_key"


def test_debug_header_explains_the_routing_decision_only_when_asked(
        make_gateway: GatewayFactory) -> None:
    gateway = _gateway_with(make_gateway, RecordingRouter())
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    plain = httpx.post(gateway.url + "/v1/chat/completions", json=chat)
    assert "x-aigw-route" not in plain.headers
    for stream in (False, True):
        asked = httpx.post(gateway.url + "/v1/chat/completions", json={**chat, "stream": stream},
                           headers={"x-aigw-debug": "1"})
        assert asked.status_code == 200
        assert asked.headers["x-aigw-route"] == f"explained {asked.headers['x-request-id']}"
