"""Hostile input against `aigw serve`'s real app (real auth and metering, SQLite and Redis
stores, raw sockets): every answer is the route's envelope with a 4xx status, never a 500."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from bench.mock_upstream import MockState, create_mock_app
from gateway.services import create_served_app
from gateway.settings import GatewaySettings
from tests.gateway.conftest import MODEL, LoopThread, start_app
from tests.raw_http import request_bytes, send_raw

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
# (method, path, body, envelope): every route that reads a credential
ROUTES = [("POST", "/v1/chat/completions", CHAT, "openai"),
          ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi"}, "openai"),
          ("POST", "/v1/responses", {"model": MODEL, "input": "hi"}, "openai"),
          ("POST", "/anthropic/v1/messages", MESSAGES, "anthropic"),
          ("POST", "/v1/messages/count_tokens", CHAT, "anthropic"),
          ("GET", "/v1/models", None, "openai"),
          ("GET", "/anthropic/v1/models", None, "anthropic"),
          ("GET", "/admin/v1/projects", None, "admin"),
          ("GET", "/dashboard/api/overview", None, "dashboard")]
# an API key's shape with a byte that is not UTF-8 in its secret, in its key id; a JWT's shape;
# a lone byte
BAD_CREDENTIALS = [b"sk-aigw-0123456789ab-secret\xff\xfe", b"sk-aigw-0123456789\xffb-secret",
                   b"eyJhbGciOiJIUzI1NiJ9.e30\xff.sig", b"\xff"]


@dataclass
class Served:
    url: str
    key: str  # the default project's invoke key
    admin_key: str  # of project `ops`
    state: MockState


async def _keys(data_dir: Path, redis_url: str | None) -> tuple[str, str]:
    """(an invoke key of project `default`, an admin key of project `ops`)."""
    from auth import AuthSettings, open_auth

    services = await open_auth(AuthSettings(data_dir=data_dir, redis_url=redis_url))
    try:
        for project in ("default", "ops"):
            await services.admin.create_project(project)
        _, key = await services.admin.create_key("default", ["ai_gateway:invoke"])
        _, admin_key = await services.admin.create_key("ops", ["ai_gateway:admin"])
        return key, admin_key
    finally:
        await services.close()


@pytest.fixture(params=["sqlite", "redis"])
def served(request: pytest.FixtureRequest, loop_thread: LoopThread, tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    """`aigw serve`'s app on one mock replica, its keys in SQLite or in a flushed Redis; the
    default project may make 1,000 requests a minute (so the meter's counters are in play)."""
    monkeypatch.setenv("AIGW_JWT_HS256_SECRET", "a-long-shared-hmac-secret-32-bytes!")
    redis_url = request.getfixturevalue("clean_redis_url") if request.param == "redis" else None
    state = MockState()
    upstream, upstream_url = loop_thread.run(start_app(create_mock_app(state)))
    key, admin_key = loop_thread.run(_keys(tmp_path, redis_url))
    settings = GatewaySettings(
        data_dir=tmp_path, redis_url=redis_url, limits={"requests_per_minute": 1000},
        models=[{"name": MODEL, "backend": "replica", "endpoints": [upstream_url]}])
    app = loop_thread.run(create_served_app(settings))
    runner, url = loop_thread.run(start_app(app))
    try:
        yield Served(url, key, admin_key, state)
    finally:
        loop_thread.run(runner.cleanup())
        loop_thread.run(upstream.cleanup())


def _assert_envelope(envelope: str, body: bytes, status: int) -> None:
    import orjson

    payload = orjson.loads(body)
    if envelope == "anthropic":
        assert payload["type"] == "error" and payload["error"]["type"], payload
    elif envelope == "openai":
        assert payload["error"]["message"] and payload["error"]["type"], payload
    else:
        assert payload["error"]["code"], payload
    assert status < 500


def test_a_credential_with_a_byte_that_is_not_utf8_is_a_401_on_every_route(
        served: Served) -> None:
    for credential in BAD_CREDENTIALS:
        for header in ("Authorization", "x-api-key"):
            value = b"Bearer " + credential if header == "Authorization" else credential
            for method, path, body, envelope in ROUTES:
                status, _, answer = send_raw(served.url, request_bytes(
                    method, path, {header: value}, body))
                assert status == 401, (credential, header, path, answer)
                _assert_envelope(envelope, answer, status)
    assert not served.state.bodies  # nothing reached the upstream


def test_admin_durations_beyond_any_clock_and_deep_nesting_are_400s(served: Served) -> None:
    admin = {"authorization": f"Bearer {served.admin_key}"}
    keys_url = served.url + "/admin/v1/projects/default/keys"
    huge = "1" + "0" * 400
    for raw in (b'{"scopes": ["ai_gateway:invoke"], "expires_in": %s}' % huge.encode(),
                b'{"scopes": ["ai_gateway:invoke"], "expires_in": 1e300}',
                b"[" * 100_000 + b"]" * 100_000,
                b'{"scopes": ["ai_gateway:invoke"], "name": "\xff"}'):
        answer = httpx.post(keys_url, content=raw, headers=admin)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["code"] == "invalid_request"
    created = httpx.post(keys_url, json={"scopes": ["ai_gateway:invoke"]}, headers=admin)
    assert created.status_code == 201
    rotate_url = f"{served.url}/admin/v1/keys/{created.json()['key_id']}/rotate"
    for raw in (b'{"grace_seconds": %s}' % huge.encode(), b'{"grace_seconds": 1e300}',
                b'{"grace_seconds": true}', b"{" * 100_000):
        answer = httpx.post(rotate_url, content=raw, headers=admin)
        assert answer.status_code == 400, answer.text
    for path in ("/admin/v1/keys/%FF%FE", "/admin/v1/projects/%FF/keys",
                 "/admin/v1/projects/%FF/usage"):
        status, _, answer = send_raw(served.url, request_bytes(
            "GET", path, {"Authorization": b"Bearer " + served.admin_key.encode()}))
        assert status == 404, (path, answer)


def test_a_max_tokens_no_counter_can_hold_is_a_400_and_counts_nothing(served: Served) -> None:
    headers = {"authorization": f"Bearer {served.key}"}
    for _ in range(3):
        answer = httpx.post(served.url + "/v1/chat/completions",
                            json={**CHAT, "max_tokens": 10**18}, headers=headers)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == "max_tokens"
        answer = httpx.post(served.url + "/anthropic/v1/messages",
                            json={**MESSAGES, "max_tokens": 10**18}, headers=headers)
        assert answer.status_code == 400, answer.text
        assert answer.json()["type"] == "error"
    assert not served.state.bodies
    answer = httpx.post(served.url + "/v1/chat/completions", json=CHAT, headers=headers)
    assert answer.status_code == 200
    # the refused requests left nothing in the minute's request counter
    assert answer.headers["x-ratelimit-remaining-requests"] == "999"
