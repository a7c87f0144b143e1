"""Hostile input against `aigw serve`'s real app (real auth and metering, SQLite and Redis
stores, raw sockets): every answer is the route's envelope with a 4xx status, never a 500."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from bench.mock_upstream import MockState, create_mock_app
from gateway.settings import GatewaySettings
from gateway.web.services import create_served_app
from tests.gateway.conftest import (
    MODEL,
    Gateway,
    GatewayFactory,
    LoopThread,
    start_app,
    wait_until,
)
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
    replica: str = ""  # the mock replica's host:port


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


@pytest.fixture
def served(request: pytest.FixtureRequest, loop_thread: LoopThread, tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    """`aigw serve`'s app on one mock replica, its keys in SQLite (or, parametrized indirectly
    with "redis", in a flushed Redis); the default project may make 1,000 requests a minute (so
    the meter's counters are in play)."""
    monkeypatch.setenv("AIGW_JWT_HS256_SECRET", "a-long-shared-hmac-secret-32-bytes!")
    store = getattr(request, "param", "sqlite")
    redis_url = request.getfixturevalue("clean_redis_url") if store == "redis" else None
    state = MockState()
    upstream, upstream_url = loop_thread.run(start_app(create_mock_app(state)))
    key, admin_key = loop_thread.run(_keys(tmp_path, redis_url))
    settings = GatewaySettings(
        data_dir=tmp_path, redis_url=redis_url, limits={"requests_per_minute": 1000},
        models=[{"name": MODEL, "backend": "replica", "endpoints": [upstream_url]}])
    app = loop_thread.run(create_served_app(settings))
    runner, url = loop_thread.run(start_app(app))
    try:
        yield Served(url, key, admin_key, state, upstream_url.split("://", 1)[1])
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


@pytest.mark.parametrize("served", ["sqlite", "redis"], indirect=True)
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


def test_a_key_sent_without_its_bearer_scheme_is_told_how_to_send_it(served: Served) -> None:
    # a beginner's curl: `-H "Authorization: $KEY"`; the 401 names both ways a key goes
    for path, body in (("/v1/chat/completions", CHAT), ("/anthropic/v1/messages", MESSAGES)):
        response = httpx.post(served.url + path, json=body,
                              headers={"Authorization": served.key})
        assert response.status_code == 401, response.text
        error = response.json()["error"]
        assert error["code"] == "missing_credential"
        assert "Authorization: Bearer <key>" in error["message"]
        assert "x-api-key: <key>" in error["message"]
        with_scheme = httpx.post(served.url + path, json=body,
                                 headers={"Authorization": f"Bearer {served.key}"})
        assert with_scheme.status_code == 200, with_scheme.text
    assert len(served.state.bodies) == 2  # only the two sent with the scheme went upstream


@pytest.mark.parametrize("served", ["sqlite", "redis"], indirect=True)
def test_admin_durations_beyond_any_clock_and_deep_nesting_are_400s(served: Served) -> None:
    admin = {"authorization": f"Bearer {served.admin_key}"}
    keys_url = served.url + "/admin/v1/projects/default/keys"
    huge = "1" + "0" * 400
    for raw in (b'{"scopes": ["ai_gateway:invoke"], "expires_in": %s}' % huge.encode(),
                b'{"scopes": ["ai_gateway:invoke"], "expires_in": 1e300}',
                b"[" * 2_000 + b"]" * 2_000,  # (over orjson's 1,024 levels, under 64 KiB)
                b'{"scopes": ["ai_gateway:invoke"], "name": "\xff"}'):
        answer = httpx.post(keys_url, content=raw, headers=admin)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["code"] == "invalid_request"
    created = httpx.post(keys_url, json={"scopes": ["ai_gateway:invoke"]}, headers=admin)
    assert created.status_code == 201
    rotate_url = f"{served.url}/admin/v1/keys/{created.json()['key_id']}/rotate"
    for raw in (b'{"grace_seconds": %s}' % huge.encode(), b'{"grace_seconds": 1e300}',
                b'{"grace_seconds": true}', b"{" * 2_000):
        answer = httpx.post(rotate_url, content=raw, headers=admin)
        assert answer.status_code == 400, answer.text
    for path in ("/admin/v1/keys/%FF%FE", "/admin/v1/projects/%FF/keys",
                 "/admin/v1/projects/%FF/usage"):
        status, _, answer = send_raw(served.url, request_bytes(
            "GET", path, {"Authorization": b"Bearer " + served.admin_key.encode()}))
        assert status == 404, (path, answer)


def test_a_whole_key_where_its_id_belongs_stands_for_its_id_and_no_answer_echoes_it(
        served: Served) -> None:
    """`GET /admin/v1/keys/<the whole key>` was a 404 whose message held the key, secret and
    all; it stands for its id now, as in `aigw keys revoke`, and an unknown one names its id."""
    admin = {"authorization": f"Bearer {served.admin_key}"}
    unknown = "sk-aigw-0123456789ab-" + "s3cr3t" * 6
    for method, path in (("GET", ""), ("DELETE", ""), ("POST", "/rotate"), ("GET", "/limits"),
                         ("PUT", "/limits")):
        answer = httpx.request(method, f"{served.url}/admin/v1/keys/{unknown}{path}",
                               headers=admin, json={} if method != "GET" else None)
        assert answer.status_code == 404, (method, path, answer.text)
        assert "s3cr3t" not in answer.text and "0123456789ab" in answer.text
    key_id, _, secret = served.key.removeprefix("sk-aigw-").partition("-")
    got = httpx.get(f"{served.url}/admin/v1/keys/{served.key}", headers=admin)
    assert got.status_code == 200 and got.json()["key_id"] == key_id
    limits = httpx.get(f"{served.url}/admin/v1/keys/{served.key}/limits", headers=admin)
    assert limits.status_code == 200, limits.text
    assert secret not in got.text + limits.text


@pytest.mark.parametrize("served", ["sqlite", "redis"], indirect=True)
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


def test_only_an_admin_caller_sees_the_gateways_timing_and_routing(served: Served) -> None:
    """x-aigw-overhead-ms moved with what a request found in caches every tenant shares (one
    request told another project whether a system prompt had been sent recently), x-aigw-route
    shows every replica's load and x-aigw-replica the serving endpoint's host:port: all three
    are for operators."""
    for key, shown in ((served.key, False), (served.admin_key, True)):
        headers = {"authorization": f"Bearer {key}", "x-aigw-debug": "1"}
        answers = [httpx.post(served.url + "/v1/chat/completions", json=CHAT, headers=headers),
                   httpx.post(served.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                              headers=headers),
                   httpx.post(served.url + "/v1/chat/completions", json={**CHAT, "n": 0},
                              headers=headers)]
        if shown:  # the admin key of `ops` may call the model too (admin implies every scope)
            assert [a.status_code for a in answers] == [200, 200, 400]
        for answer in answers:  # (a refusal before admission carries no timing for anyone)
            admitted = answer.status_code == 200
            assert ("x-aigw-overhead-ms" in answer.headers) == (shown and admitted)
            assert ("x-aigw-route" in answer.headers) == (shown and admitted)
            replica = answer.headers.get("x-aigw-replica")
            if shown and admitted:
                assert replica is not None and replica == served.replica
            else:  # nothing of the fleet: no header, or "none" for a refusal before dispatch
                assert replica in (None, "none"), replica
        refused = httpx.post(served.url + "/v1/chat/completions", json=CHAT,
                             headers={"authorization": "Bearer sk-aigw-0123456789ab-nope"})
        assert refused.status_code == 401 and "x-aigw-overhead-ms" not in refused.headers


def test_count_tokens_is_admitted_and_metered_like_a_messages_request(served: Served) -> None:
    headers = {"authorization": f"Bearer {served.key}"}
    remaining = []
    for _ in range(2):
        answer = httpx.post(served.url + "/v1/messages/count_tokens", json=MESSAGES,
                            headers=headers)
        assert answer.status_code == 200 and answer.json()["input_tokens"] > 0
        remaining.append(int(answer.headers["x-ratelimit-remaining-requests"]))
    # counted like a request: one of the minute's 1,000 (the second is 999 again only when the
    # minute's window rolled over between the two)
    assert remaining[0] == 999 and remaining[1] in (998, 999)
    answer = httpx.post(served.url + "/v1/messages/count_tokens",
                        json={**MESSAGES, "max_tokens": None}, headers=headers)
    assert answer.status_code == 200
    assert not served.state.bodies  # counted in the gateway


def test_count_tokens_refuses_a_prompt_surely_over_the_context_without_encoding_it(
        served: Served) -> None:
    """count_tokens encoded whole bodies (an 8 MB message: seconds of tokenizer time holding the
    GIL) with no over-context guard; the mock replica's context is 4,096 tokens."""
    headers = {"authorization": f"Bearer {served.key}"}
    body = {**MESSAGES, "messages": [{"role": "user", "content": "word " * 1_000_000}]}
    started = time.monotonic()
    answer = httpx.post(served.url + "/v1/messages/count_tokens", json=body, headers=headers,
                        timeout=30)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert "context length" in answer.json()["error"]["message"]
    assert time.monotonic() - started < 2.0


def test_other_headers_with_bytes_that_are_not_utf8_never_make_a_500(served: Served) -> None:
    headers = {"Authorization": b"Bearer " + served.key.encode()}
    for name in ("x-session-id", "x-request-id", "traceparent", "tracestate", "anthropic-version",
                 "x-aigw-debug", "user-agent", "content-encoding", "accept"):
        for method, path, body, envelope in ROUTES:
            status, _, answer = send_raw(served.url, request_bytes(
                method, path, {**headers, name: b"\xff\xfe-\x80"}, body))
            assert status < 500, (name, path, answer)
            if status >= 400:
                _assert_envelope(envelope, answer, status)


def test_a_usage_ledger_that_cannot_keep_up_refuses_new_requests_with_a_503(
        served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """Back-pressure from the meter (its queued usage writes past metering_backlog_max_bytes,
    tests/gateway/metering/test_redis_outage.py makes them with a hung Redis) is a 503 in each
    route's envelope, and nothing reaches the upstream."""
    from gateway.metering.embedded_meter import EmbeddedMeter

    monkeypatch.setattr(EmbeddedMeter, "backlog_bytes", lambda self: 1 << 40)
    headers = {"authorization": f"Bearer {served.key}"}
    answer = httpx.post(served.url + "/v1/chat/completions", json=CHAT, headers=headers)
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "metering_backlogged"
    answer = httpx.post(served.url + "/anthropic/v1/messages", json=MESSAGES, headers=headers)
    assert answer.status_code == 503 and answer.json()["type"] == "error", answer.text
    answer = httpx.post(served.url + "/v1/messages/count_tokens", json=MESSAGES, headers=headers)
    assert answer.status_code == 503 and answer.json()["type"] == "error", answer.text
    assert not served.state.bodies


@pytest.fixture
def fake_engine() -> Any:
    from tests.engine.server.fakes import FakeEngine

    return FakeEngine()


@pytest.fixture
def on_replica(make_gateway: GatewayFactory, loop_thread: LoopThread,
               fake_engine: Any) -> Iterator[Gateway]:
    """The gateway on a real replica app (engine/server) over the fake engine."""
    from engine.server import ReplicaServerSettings
    from engine.server import create_app as create_replica_app

    engine = fake_engine
    runner, url = loop_thread.run(start_app(create_replica_app(engine, ReplicaServerSettings())))
    models = [{"name": MODEL, "upstream_model": str(engine.model_config.model_id),
               "backend": "replica", "endpoints": [url]}]
    yield make_gateway(models=models)
    loop_thread.run(runner.cleanup())


def test_a_schema_whose_recursion_never_ends_is_each_dialects_400(on_replica: Gateway) -> None:
    """`{"$ref": "#"}` (or a required property that is the object again) has no finite value:
    the replica's grammar allowed no first token and the answer was an empty 200."""
    import anthropic
    import openai

    endless = {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]}
    chat = openai.OpenAI(base_url=on_replica.url + "/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        chat.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                     response_format={"type": "json_schema", "json_schema": {
                                         "name": "x", "schema": endless}})
    assert "'$ref': '#' admits no finite value" in refused.value.message
    with pytest.raises(openai.BadRequestError):
        chat.responses.create(model=MODEL, input="hi", text={"format": {
            "type": "json_schema", "name": "x", "schema": {"$ref": "#"}}})
    messages = anthropic.Anthropic(base_url=on_replica.url + "/anthropic", api_key="k",
                                   max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as rejected:
        messages.messages.create(model=MODEL, max_tokens=8, messages=[
            {"role": "user", "content": "hi"}], tools=[{"name": "f", "input_schema": endless}],
            tool_choice={"type": "any"})
    error = rejected.value.body["error"]  # type: ignore[index]
    assert error["type"] == "invalid_request_error" and "admits no finite value" in error["message"]
    # each refusal settled once, at nothing
    assert wait_until(lambda: on_replica.meter.num_settle_calls == 3)
    assert {(r.status, r.prompt_tokens, r.completion_tokens, r.cost_usd)
            for r in on_replica.meter.settled.values()} == {(400, 0, 0, 0.0)}


def test_the_memo_of_checked_sampling_values_holds_no_callers_stop_strings_in_bulk(
        gateway: Gateway) -> None:
    """The dialects remember sampling combinations already checked; a key holds the request's
    stop strings, and a count bound alone (4,096 keys) let a caller park 4 x 8 MiB of stop
    strings in each: gigabytes. Now bounded in bytes, and an entry over 4 KiB is not kept; and a
    stop string over MAX_STOP_BYTES is refused before it is remembered."""
    from contracts.sampling_params import MAX_STOP_BYTES
    from gateway.dialects import validate

    def held_bytes() -> int:
        memo: Any = validate._VALID_SAMPLING
        keys = getattr(memo, "_entries", memo)
        return sum(len(part) for key in keys for part in key if isinstance(part, str))

    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        for i in range(8):
            stop = [f"{i}-{j}-" + "s" * (200 << 10) for j in range(4)]  # (under 1 MiB)
            answer = client.post("/v1/chat/completions", json={**CHAT, "stop": stop})
            assert answer.status_code == 400, answer.text
            stop = [f"{i}-{j}-".ljust(MAX_STOP_BYTES, "s") for j in range(4)]
            answer = client.post("/v1/chat/completions", json={**CHAT, "stop": stop})
            assert answer.status_code == 200, answer.text
    assert held_bytes() < 1 << 20


def test_query_numbers_int_cannot_read_are_400s_not_500s(gateway: Gateway) -> None:
    """str.isdigit() is true of '²' and of a 5,000-digit string; int() reads neither."""
    stored = httpx.post(gateway.url + "/v1/responses", json={"model": MODEL, "input": "hi"})
    response_id = stored.json()["id"]
    for value in ("²", "9" * 5000):
        for path, query in ((f"/v1/responses/{response_id}/input_items", {"limit": value}),
                            (f"/v1/responses/{response_id}",
                             {"stream": "true", "starting_after": value})):
            answer = httpx.get(gateway.url + path, params=query)
            assert answer.status_code == 400, (path, query, answer.text)
            assert answer.json()["error"]["param"] in ("limit", "starting_after")


def test_a_cache_salt_in_the_body_never_replaces_the_callers_own(on_replica: Gateway,
                                                                 fake_engine: Any) -> None:
    """The replica keys its prefix cache (and built grammars) by the body's cache_salt: a
    caller naming another tenant's salt would share that tenant's cache."""
    for path, body in (("/v1/chat/completions", {**CHAT, "cache_salt": "project:victim"}),
                       ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                            "cache_salt": ""}),
                       ("/anthropic/v1/messages", {**MESSAGES, "cache_salt": "project:victim"})):
        assert httpx.post(on_replica.url + path, json=body).status_code == 200
    assert [call.cache_salt for call in fake_engine.calls] == ["project:anonymous"] * 3


def test_the_admin_api_refuses_a_body_with_the_status_the_gateway_refuses_it_with(
        served: Served) -> None:
    """An admin body in a Content-Encoding not decoded here was a 400 (every other route: 415),
    one over its bound a 400 (413); now the same statuses, in the admin envelope, on the key,
    limit and request-log routes alike."""
    from gateway.web.admin_routes import MAX_ADMIN_BODY_BYTES

    admin = {"Authorization": f"Bearer {served.admin_key}".encode()}
    writes = [("POST", "/admin/v1/projects", {"name": "p1"}),
              ("POST", "/admin/v1/projects/default/keys", {"scopes": ["ai_gateway:invoke"]}),
              ("PUT", "/admin/v1/projects/default/limits", {"requests_per_minute": 5}),
              ("PUT", "/admin/v1/projects/default/request-log-settings", {"enabled": True})]
    for method, path, body in writes:
        for encoding in ("foo", "gzip, deflate"):
            status, _, answer = send_raw(served.url, request_bytes(
                method, path, {**admin, "Content-Encoding": encoding.encode()}, body))
            error = orjson.loads(answer)["error"]
            assert (status, error["type"], error["code"]) == (
                415, "admin_error", "unsupported_media_type"), (path, answer)
            assert repr(encoding) in error["message"]
        huge = {"name": "x" * MAX_ADMIN_BODY_BYTES}
        status, _, answer = send_raw(served.url, request_bytes(method, path, admin, huge))
        assert status == 413 and orjson.loads(answer)["error"]["code"] == "payload_too_large", (
            path, answer)
        status, _, answer = send_raw(served.url, request_bytes(
            method, path, {**admin, "Content-Encoding": b"gzip"}, body))  # not gzip
        assert status == 400 and orjson.loads(answer)["error"]["code"] == "invalid_request"
    projects = httpx.get(served.url + "/admin/v1/projects",
                         headers={"authorization": f"Bearer {served.admin_key}"}).json()
    assert "p1" not in {p["name"] for p in projects["data"]}  # nothing was written


def test_an_admin_body_that_does_not_arrive_in_time_is_a_408(loop_thread: LoopThread,
                                                            tmp_path: Path) -> None:
    """Admin bodies were read without a deadline: a caller that sent its headers and then a
    byte now and then held a handler for as long as it liked. client_body_timeout_s holds on
    the admin routes as on every other."""
    import socket

    _, admin_key = loop_thread.run(_keys(tmp_path, None))
    settings = GatewaySettings(data_dir=tmp_path, client_body_timeout_s=0.5, models=[
        {"name": MODEL, "backend": "replica", "endpoints": ["http://127.0.0.1:9"]}])
    runner, url = loop_thread.run(start_app(loop_thread.run(create_served_app(settings))))
    host, port = url.removeprefix("http://").split(":")
    try:
        for method, path in (("POST", "/admin/v1/projects"),
                             ("PUT", "/admin/v1/projects/default/limits"),
                             ("PUT", "/admin/v1/projects/default/request-log-settings")):
            with socket.create_connection((host, int(port)), timeout=10) as slow:
                slow.sendall(f"{method} {path} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer "
                             f"{admin_key}\r\nContent-Type: application/json\r\n"
                             f"Content-Length: 40\r\n\r\n{{\"name\"".encode())
                started = time.monotonic()
                answer = b""  # (read to the answer's end: the server lingers on the body)
                while not answer.endswith(b"}}") and (chunk := slow.recv(65536)):
                    answer += chunk
            assert answer.startswith(b"HTTP/1.1 408"), (path, answer[:200])
            assert b"connection: close" in answer.lower()
            assert time.monotonic() - started < 5
            error = orjson.loads(answer.partition(b"\r\n\r\n")[2])["error"]
            assert (error["type"], error["code"]) == ("admin_error", "request_timeout")
    finally:
        loop_thread.run(runner.cleanup())
