"""The admin API on a real aiohttp socket, on both stores."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import jwt
from aiohttp import web
from aiohttp.test_utils import TestServer

from auth import AuthError, AuthServices, Principal, Scope, open_auth
from auth.settings import AuthSettings
from gateway.metering import MeteringSettings, UsageRecord, open_meter
from gateway.web.admin_routes import build_admin_routes

ADMIN, INVOKE, USAGE = Scope.ADMIN.value, Scope.INVOKE.value, Scope.USAGE_READ.value


def _record(request_id: str, project: str, key_id: str, tokens: int) -> UsageRecord:
    return UsageRecord(request_id=request_id, project=project, key_id=key_id, model="m",
                       endpoint="r0", prompt_tokens=tokens, cached_tokens=0,
                       completion_tokens=tokens, cost_usd=0.0, latency_ms=1.0, status=200,
                       created_at=time.time())


@contextlib.asynccontextmanager
async def ops_admin_api(settings: AuthSettings) -> AsyncIterator[tuple[AuthServices, str, str]]:
    """The admin API over a fresh auth store with a project `ops`: (the auth services, the API's
    base URL, an admin key of `ops`)."""
    services = await open_auth(settings)
    await services.admin.create_project("ops")
    _, admin_key = await services.admin.create_key("ops", [ADMIN])
    app = web.Application()
    app.add_routes(build_admin_routes(services))
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    try:
        yield services, str(server.make_url("/admin/v1")), admin_key
    finally:
        await server.close()
        await services.close()


def test_admin_api_manages_keys_and_guards_usage_by_project(auth_settings: AuthSettings) -> None:
    settings = auth_settings.model_copy(update={"jwt_hs256_secret": "x" * 32,
                                                "jwt_algorithms": ("HS256",)})

    async def scenario() -> None:
        async with ops_admin_api(settings) as (services, base, admin_key):
            async with aiohttp.ClientSession() as http:
                async def call(method: str, path: str, key: str | None = None,
                               body: Any = None) -> tuple[int, Any]:
                    headers = {"Authorization": f"Bearer {key}"} if key else {}
                    async with http.request(method, base + path, json=body,
                                            headers=headers) as resp:
                        is_json = resp.content_type == "application/json"
                        return resp.status, await (resp.json() if is_json else resp.text())

                assert (await call("GET", "/projects"))[0] == 401
                assert (await call("GET", "/projects", "sk-aigw-000000000000-bad"))[0] == 401
                for name in ("a", "b"):
                    assert (await call("POST", "/projects", admin_key, {"name": name}))[0] == 201
                assert (await call("POST", "/projects", admin_key, {"name": "a"}))[0] == 409
                status, created = await call("POST", "/projects/a/keys", admin_key,
                                             {"scopes": [INVOKE, USAGE], "name": "app"})
                assert status == 201 and created["key"].startswith("sk-aigw-")
                key_a = created["key"]
                status, listed = await call("GET", "/projects/a/keys", admin_key)
                assert [k["key_id"] for k in listed["data"]] == [created["key_id"]]
                assert "secret_hash" not in listed["data"][0] and "key" not in listed["data"][0]
                assert (await call("GET", "/projects", key_a))[0] == 403  # no admin scope
                assert (await call("POST", "/projects/zzz/keys", admin_key,
                                   {"scopes": [INVOKE]}))[0] == 404
                assert (await call("POST", "/projects/a/keys", admin_key,
                                   {"scopes": ["root"]}))[0] == 400

                meter = await open_meter(MeteringSettings(), redis=services.redis,
                                         data_dir=settings.data_dir)
                principal = Principal("a", created["key_id"], frozenset([INVOKE]))
                for request_id, project, tokens in (("r1", "a", 3), ("r2", "b", 5),
                                                    ("r3", "jwt-only", 7)):
                    admission = await meter.admit(request_id, principal, "m", tokens, 16)
                    await meter.settle(admission, _record(request_id, project, "k", tokens))
                await meter.close()

                status, usage = await call("GET", "/projects/a/usage", key_a)
                assert status == 200 and usage["data"][0]["prompt_tokens"] == 3
                status, error = await call("GET", "/projects/b/usage", key_a)
                assert status == 403 and error["error"]["code"] == "wrong_project"
                status, csv_text = await call("GET", "/projects/b/usage?format=csv&group_by=model",
                                              admin_key)
                assert status == 200 and csv_text.splitlines()[1].startswith(",m,1,5,0,5,10,")
                status, error = await call("GET", "/projects/a/usage?since=yesterday", admin_key)
                assert status == 400 and "since" in error["error"]["message"]
                status, error = await call("GET", "/projects/a/usage?format=xml", admin_key)
                assert status == 400 and "format" in error["error"]["message"]
                assert (await call("GET", "/projects/a/usage?since=2020-01-01&until=2999-12-31",
                                   admin_key))[0] == 200
                status, error = await call("GET", "/projects/zzz/usage", admin_key)
                assert status == 404 and error["error"]["code"] == "unknown_project"

                token = jwt.encode({"sub": "ci", "project": "b", "scope": USAGE,
                                    "exp": int(time.time()) + 60}, "x" * 32, algorithm="HS256")
                assert (await call("GET", "/projects/b/usage", token))[0] == 200
                assert (await call("GET", "/projects/a/usage", token))[0] == 403
                # A project named only by JWTs is in no store, yet it has usage to read.
                jwt_only = jwt.encode({"sub": "ci", "project": "jwt-only", "scope": USAGE,
                                       "exp": int(time.time()) + 60}, "x" * 32, algorithm="HS256")
                for caller in (jwt_only, admin_key):
                    status, usage = await call("GET", "/projects/jwt-only/usage", caller)
                    assert status == 200 and usage["data"][0]["prompt_tokens"] == 7

                status, rotated = await call("POST", f"/keys/{created['key_id']}/rotate",
                                             admin_key, {"grace_seconds": 0})
                assert status == 200 and rotated["key"] != key_a
                status, revoked = await call("DELETE", f"/keys/{created['key_id']}", admin_key)
                assert status == 200 and revoked["revoked_at"] is not None
                assert (await call("DELETE", "/keys/000000000000", admin_key))[0] == 404

    asyncio.run(scenario())


def test_a_key_revoked_or_rotated_through_the_admin_api_is_refused_by_that_gateway_at_once(
        tmp_path: Path) -> None:
    """The instance that revokes knows it first: no wait for its own revocation watcher (a 1 s
    poll and a 60 s key cache here, so only the admin route itself can make this pass)."""
    settings = AuthSettings(data_dir=tmp_path, revocation_poll_interval_s=1.0, key_cache_ttl_s=60.0)

    async def scenario() -> None:
        async with ops_admin_api(settings) as (services, base, admin_key):
            revoked, revoked_key = await services.admin.create_key("ops", [INVOKE])
            rotated, rotated_key = await services.admin.create_key("ops", [INVOKE])
            headers = {"Authorization": f"Bearer {admin_key}"}
            for key in (revoked_key, rotated_key):
                await services.authenticator.authenticate(key)  # cached now
            async with aiohttp.ClientSession() as http:
                async with http.delete(f"{base}/keys/{revoked.key_id}", headers=headers) as resp:
                    assert resp.status == 200
                async with http.post(f"{base}/keys/{rotated.key_id}/rotate", headers=headers,
                                     json={"grace_seconds": 0}) as resp:
                    assert resp.status == 200
                    new_key = (await resp.json())["key"]
            for key, code in ((revoked_key, "revoked_api_key"), (rotated_key, "invalid_api_key")):
                try:
                    await services.authenticator.authenticate(key)
                except AuthError as exc:
                    assert exc.code == code
                else:
                    raise AssertionError(f"{code}: the key still works")
            assert (await services.authenticator.authenticate(new_key)).key_id == rotated.key_id

    asyncio.run(scenario())


def test_key_fields_that_would_grant_more_or_break_json_are_refused(tmp_path: Path) -> None:
    """`models: []` is not "every model"; NaN/Infinity/true are not durations (a NaN expiry never
    expired and made every later key listing invalid JSON); a name is a string."""
    async def scenario() -> None:
        async with (ops_admin_api(AuthSettings(data_dir=tmp_path)) as (_, base, admin_key),
                    aiohttp.ClientSession() as http):
            headers = {"Authorization": f"Bearer {admin_key}", "content-type": "application/json"}
            for body in ('{"scopes": ["ai_gateway:invoke"], "models": []}',
                         '{"scopes": ["ai_gateway:invoke"], "models": [""]}',  # MODEL unset
                         '{"scopes": ["ai_gateway:invoke"], "expires_in": NaN}',
                         '{"scopes": ["ai_gateway:invoke"], "expires_in": Infinity}',
                         '{"scopes": ["ai_gateway:invoke"], "expires_in": true}',
                         '{"scopes": ["ai_gateway:invoke"], "name": {"a": 1}}'):
                async with http.post(f"{base}/projects/ops/keys", data=body,
                                     headers=headers) as resp:
                    assert resp.status == 400, body
            async with http.post(f"{base}/projects/ops/keys", headers=headers,
                                 json={"scopes": [INVOKE]}) as resp:
                key_id = (await resp.json())["key_id"]
            for grace in ("NaN", "true", "-1"):
                async with http.post(f"{base}/keys/{key_id}/rotate", headers=headers,
                                     data=f'{{"grace_seconds": {grace}}}') as resp:
                    assert resp.status == 400, grace
            async with http.get(f"{base}/projects/ops/keys", headers=headers) as resp:
                text = await resp.text()
                assert "NaN" not in text and "Infinity" not in text  # strict JSON
                assert len(json.loads(text)["data"]) == 2

    asyncio.run(scenario())


def test_a_body_that_is_not_utf8_or_not_its_content_encoding_is_a_400_not_a_500(
        tmp_path: Path) -> None:
    async def scenario() -> None:
        async with (ops_admin_api(AuthSettings(data_dir=tmp_path)) as (_, base, admin_key),
                    aiohttp.ClientSession() as http):
            headers = {"Authorization": f"Bearer {admin_key}", "content-type": "application/json"}
            for body, extra in ((b'{"name": "fz\xff"}', {}),
                                (b'{"name": "fz"}', {"content-encoding": "gzip"})):
                async with http.post(f"{base}/projects", data=body,
                                     headers={**headers, **extra}) as resp:
                    assert resp.status == 400, body
                    error = (await resp.json())["error"]
                    assert error["type"] == "admin_error" and error["code"] == "invalid_request"

    asyncio.run(scenario())
