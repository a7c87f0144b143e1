"""A replica with a secret serves only callers that present it: every route but /health and
/metrics (each route the app registers, so a new one is covered too, and unknown paths), with a
401 in the OpenAI envelope otherwise; a header byte that is not UTF-8 is a 401, never a 500."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from engine.server import ReplicaServerSettings, create_app
from engine.server.middlewares import OPEN_PATHS
from engine.server.settings import read_secret
from tests.engine.server.conftest import ServerThread
from tests.engine.server.fakes import FakeEngine

SECRET = "s3cret-for-the-gateway"


@pytest.fixture
def settings() -> ReplicaServerSettings:
    return ReplicaServerSettings(secret=SECRET)


@pytest.fixture
def raw(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        yield client


def _guarded_routes() -> list[tuple[str, str]]:
    app = create_app(FakeEngine(), ReplicaServerSettings(secret=SECRET))
    routes = {(r.method, r.resource.canonical) for r in app.router.routes()  # type: ignore[union-attr]
              if r.method != "HEAD"}
    return sorted(r for r in routes if r[1] not in OPEN_PATHS) + [("GET", "/no/such/route")]


def test_every_route_but_health_and_metrics_is_guarded() -> None:
    paths = {path for _, path in _guarded_routes()}
    assert {"/kv/events", "/kv/snapshot", "/kv/reset", "/v1/chat/completions",
            "/v1/completions", "/v1/models", "/debug/traces"} <= paths


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {SECRET}", "Bearer",
                                           f"Bearer {SECRET}x"],
                         ids=["none", "wrong", "not_bearer", "empty", "longer"])
def test_a_caller_without_the_secret_gets_401_on_every_guarded_route(
        raw: httpx.Client, fake_engine: FakeEngine, authorization: str | None) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    for method, path in _guarded_routes():
        response = raw.request(method, path, headers=headers, json={"model": "fake-model"})
        assert response.status_code == 401, (method, path, response.text)
        assert response.json()["error"]["type"] == "authentication_error"
        assert response.headers["x-request-id"]
    assert fake_engine.calls == [] and fake_engine.num_prefix_cache_resets == 0


def test_the_secret_opens_every_route(raw: httpx.Client, fake_engine: FakeEngine) -> None:
    headers = {"Authorization": f"Bearer {SECRET}"}
    assert raw.get("/kv/events?since=0", headers=headers).status_code == 200
    assert raw.get("/kv/snapshot", headers=headers).status_code == 200
    assert raw.post("/kv/reset", headers=headers).status_code == 200
    reply = raw.post("/v1/chat/completions", headers=headers, json={
        "model": "fake-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 200 and len(fake_engine.calls) == 1


def test_health_and_metrics_stay_open_and_name_no_tenant(
        raw: httpx.Client, fake_engine: FakeEngine) -> None:
    reply = raw.post("/v1/chat/completions", headers={"Authorization": f"Bearer {SECRET}"}, json={
        "model": "fake-model", "max_tokens": 4, "cache_salt": "project-acme",
        "messages": [{"role": "user", "content": "a secret system prompt"}]})
    assert reply.status_code == 200
    health = raw.get("/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    metrics = raw.get("/metrics")
    assert metrics.status_code == 200
    assert "acme" not in metrics.text and "secret" not in metrics.text


def test_a_credential_byte_that_is_not_utf8_is_a_401_not_a_500(server: ServerThread) -> None:
    parts = urlsplit(server.base_url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(b"GET /kv/events HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe"
                     + SECRET.encode() + b"\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 401 "), answer[:200]
    assert b"authentication_error" in answer


def test_the_secret_is_read_from_the_environment_or_a_file(tmp_path: Path) -> None:

    path = tmp_path / "replica-secret"
    path.write_text("from-a-file\n")  # as `kubectl create secret --from-file` mounts it
    assert read_secret({"AIGW_REPLICA_SECRET": "from-env"}) == "from-env"
    assert read_secret({"AIGW_REPLICA_SECRET_FILE": str(path)}) == "from-a-file"
    assert read_secret({"AIGW_REPLICA_SECRET": "", "AIGW_REPLICA_SECRET_FILE": ""}) is None
    path.write_text("")
    with pytest.raises(ValueError, match="empty"):
        read_secret({"AIGW_REPLICA_SECRET_FILE": str(path)})
    assert SECRET not in repr(ReplicaServerSettings(secret=SECRET))


@pytest.mark.parametrize("secret", [SECRET, None])
def test_the_rest_of_a_refused_compressed_body_is_never_inflated(secret: str | None) -> None:
    """A 4 MB gzip body of zeros without the secret (401), or over client_max_size_bytes (413),
    went on to inflate to GiBs on the replica's event loop as aiohttp's lingering close read it
    to discard it; now the connection closes with the answer, the rest never read."""
    import asyncio

    from aiohttp import web

    from infra.http_server import GuardedAppRunner
    from tests.raw_http import post_gzip_of_zeros

    app = create_app(FakeEngine(), ReplicaServerSettings(secret=secret,
                                                         client_max_size_bytes=1 << 20))
    bodies: list[Any] = []

    @web.middleware
    async def keep_body(request: web.Request, handler: Any) -> web.StreamResponse:
        bodies.append(request.content)
        return await handler(request)  # type: ignore[no-any-return]

    app.middlewares.insert(0, keep_body)

    async def refused() -> bytes:  # (the replica's runner; aiohttp's 10 s lingering: 1 s)
        runner = GuardedAppRunner(app, header_timeout_s=10, lingering_time=1.0)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            return await asyncio.to_thread(post_gzip_of_zeros, f"http://127.0.0.1:"
                                           f"{runner.addresses[0][1]}", "/v1/completions", 4096)
        finally:
            await runner.cleanup()

    answer = asyncio.run(refused())
    assert answer.startswith(b"HTTP/1.1 401" if secret else b"HTTP/1.1 413"), answer[:200]
    assert b"connection: close" in answer.lower() and b'"error"' in answer
    (content,) = bodies
    assert content.total_bytes < 8 << 20, content.total_bytes  # (of 4 GiB sent)
