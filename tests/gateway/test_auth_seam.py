"""The auth and metering seams: credentials from either header, 401/403/429 in each dialect's
envelope, admit before dispatch and settle exactly once."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from auth.principal import AuthError, Principal, Scope
from gateway.metering.contract import Admission, RateLimited, UsageRecord
from tests.gateway.conftest import MODEL, GatewayFactory, wait_until

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {**CHAT, "max_tokens": 5}


class KeyAuthenticator:
    """'good' may invoke anything, 'noscope' lacks invoke, 'narrow' may call another model only,
    'admin' is an operator's key (admin and invoke)."""

    def __init__(self) -> None:
        self.seen: list[str | None] = []

    async def authenticate(self, credential: str | None) -> Principal:
        self.seen.append(credential)
        if credential == "good":
            return Principal("proj", "k1", frozenset({Scope.INVOKE.value}))
        if credential == "admin":
            return Principal("ops", "k0", frozenset({Scope.INVOKE.value, Scope.ADMIN.value}))
        if credential == "noscope":
            return Principal("proj", "k2", frozenset({Scope.USAGE_READ.value}))
        if credential == "narrow":
            return Principal("proj", "k3", frozenset({Scope.INVOKE.value}), frozenset({"other"}))
        raise AuthError(401, "invalid_api_key", "unknown key")


class RecordingMeter:
    def __init__(self, limited: bool = False) -> None:
        self.limited = limited
        self.admitted: list[tuple[str, int, int]] = []
        self.settled: list[UsageRecord] = []

    async def admit(self, request_id: str, principal: Principal, model: str, num_prompt_tokens: int,
                    max_tokens: int) -> Admission:
        if self.limited:
            raise RateLimited("too many requests", 7.0, {"retry-after": "7",
                                                         "x-ratelimit-remaining-requests": "0"})
        self.admitted.append((request_id, num_prompt_tokens, max_tokens))
        return Admission(request_id, principal, model, num_prompt_tokens + max_tokens,
                         headers={"x-ratelimit-remaining-requests": "9"})

    async def settle(self, admission: Admission, record: UsageRecord) -> None:
        self.settled.append(record)


@pytest.mark.parametrize("headers", [{"authorization": "Bearer good"}, {"x-api-key": "good"}])
def test_credential_is_taken_from_either_header(make_gateway: GatewayFactory,
                                                headers: dict[str, str]) -> None:
    authenticator, meter = KeyAuthenticator(), RecordingMeter()
    gateway = make_gateway(authenticator=authenticator, meter=meter)
    response = httpx.post(gateway.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 7},
                          headers=headers)
    assert response.status_code == 200
    assert response.headers["x-ratelimit-remaining-requests"] == "9"
    assert authenticator.seen == ["good"]
    request_id = response.headers["x-request-id"]
    assert [a[0] for a in meter.admitted] == [request_id] and meter.admitted[0][2] == 7
    assert wait_until(lambda: meter.settled)  # settled after the answer was sent
    assert [r.request_id for r in meter.settled] == [request_id]
    assert meter.settled[0].project == "proj" and meter.settled[0].key_id == "k1"


@pytest.mark.parametrize(("path", "body", "key", "status", "code"), [
    ("/v1/chat/completions", CHAT, None, 401, "invalid_api_key"),
    ("/v1/chat/completions", CHAT, "bad", 401, "invalid_api_key"),
    ("/v1/responses", {"model": MODEL, "input": "hi"}, "noscope", 403, "insufficient_scope"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi"}, "narrow", 403, "model_not_allowed"),
    ("/anthropic/v1/messages", MESSAGES, "bad", 401, "invalid_api_key"),
    ("/anthropic/v1/messages", MESSAGES, "narrow", 403, "model_not_allowed"),
])
def test_auth_errors_answer_in_the_route_envelope(make_gateway: GatewayFactory, path: str,
                                                  body: dict, key: str | None, status: int,
                                                  code: str) -> None:
    meter = RecordingMeter()
    gateway = make_gateway(authenticator=KeyAuthenticator(), meter=meter)
    headers = {"x-api-key": key} if key else {}
    response = httpx.post(gateway.url + path, json=body, headers=headers)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == code
    if path.startswith("/anthropic"):
        assert response.json()["type"] == "error"
        assert error["type"] == ("authentication_error" if status == 401 else "permission_error")
    assert not meter.admitted and not meter.settled and not gateway.upstreams[0].state.request_ids


def test_rate_limited_gives_429_with_the_meters_headers(make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(authenticator=KeyAuthenticator(), meter=RecordingMeter(limited=True))
    response = httpx.post(gateway.url + "/v1/messages", json=MESSAGES,
                          headers={"x-api-key": "good"})
    assert response.status_code == 429
    assert response.headers["retry-after"] == "7"
    assert response.json()["error"]["type"] == "rate_limit_error"
    assert not gateway.upstreams[0].state.request_ids


def test_models_list_needs_a_credential_and_hides_disallowed_models(
        make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(authenticator=KeyAuthenticator(), meter=RecordingMeter())
    assert httpx.get(gateway.url + "/v1/models").status_code == 401
    narrow = httpx.get(gateway.url + "/v1/models", headers={"authorization": "Bearer narrow"})
    assert narrow.json()["data"] == []
    good = httpx.get(gateway.url + "/v1/models", headers={"authorization": "Bearer good"})
    assert [m["id"] for m in good.json()["data"]] == [MODEL]


def test_cache_salt_follows_the_callers_project_unless_the_model_shares_its_cache(
        make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(authenticator=KeyAuthenticator(), meter=RecordingMeter())
    upstream = gateway.upstreams[0]
    httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, headers={"x-api-key": "good"})
    assert upstream.state.bodies[-1]["cache_salt"] == "project:proj"
    shared = make_gateway(num_upstreams=0, authenticator=KeyAuthenticator(), meter=RecordingMeter(),
                          models=[{"name": MODEL, "endpoints": [upstream.url],
                                   "share_cache_across_projects": True}])
    httpx.post(shared.url + "/v1/chat/completions", json=CHAT, headers={"x-api-key": "good"})
    assert "cache_salt" not in upstream.state.bodies[-1]


def test_one_model_is_retrieved_by_both_sdks_and_hidden_models_are_not_found(
        make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(authenticator=KeyAuthenticator(), meter=RecordingMeter())
    openai_client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="good", max_retries=0)
    model = openai_client.models.retrieve(MODEL)
    assert (model.id, model.object) == (MODEL, "model")
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("no-such-model")
    narrow = openai.OpenAI(base_url=gateway.url + "/v1", api_key="narrow", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        narrow.models.retrieve(MODEL)  # exists, but this key may not call it
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gateway.url + "/v1", api_key="bad",
                      max_retries=0).models.retrieve(MODEL)

    anthropic_client = anthropic.Anthropic(base_url=gateway.url + "/anthropic", api_key="good",
                                           max_retries=0)
    assert [m.id for m in anthropic_client.models.list()] == [MODEL]
    assert anthropic_client.models.retrieve(MODEL).type == "model"
    with pytest.raises(anthropic.NotFoundError):
        anthropic_client.models.retrieve("no-such-model")
    denied = httpx.get(gateway.url + "/anthropic/v1/models")
    assert denied.status_code == 401 and denied.json()["type"] == "error"  # Anthropic's envelope


class StoreDownAuthenticator:
    """An API key past its cache lifetime, with Redis stopped: the store read raises."""

    async def authenticate(self, credential: str | None) -> Principal:
        import redis.exceptions

        raise redis.exceptions.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection "
                                               "refused.")


@pytest.mark.parametrize(("path", "body"),
                         [("/v1/chat/completions", CHAT), ("/v1/messages", MESSAGES)])
def test_an_unreachable_key_store_is_a_503_in_the_routes_envelope_not_a_500(
        make_gateway: GatewayFactory, path: str, body: dict[str, object]) -> None:
    gateway = make_gateway(authenticator=StoreDownAuthenticator(), meter=RecordingMeter())
    response = httpx.post(gateway.url + path, json=body, headers={"x-api-key": "sk-aigw-x"})
    assert response.status_code == 503, response.text  # was 500 internal_error
    error = response.json()["error"]
    assert error["code"] == "store_unavailable"  # both envelopes carry it
    assert "unreachable" in error["message"] and "6379" not in error["message"]
