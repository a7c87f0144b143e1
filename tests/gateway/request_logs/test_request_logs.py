"""Request logs on a served gateway (real auth, the embedded SQLite store or a real redis-server):
written for the projects that opt in, sampled, redacted, bounded per entry and per project,
retained, readable through the admin API with its filters and pages, and tenant-scoped."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.metering.contract import UsageRecord
from gateway.request_logs import Capture, LogQuery, RequestLog, RequestLogSettings
from gateway.request_logs.entry import LogEntry, build_entry
from gateway.request_logs.redact import REDACTED
from gateway.request_logs.store_redis import RedisLogStore
from gateway.request_logs.store_sqlite import SqliteLogStore
from gateway.settings import GatewaySettings
from gateway.web.services import create_served_app
from tests.gateway.conftest import LoopThread, start_app, wait_until
from tests.gateway.scripted_upstream import create_scripted_upstream

MODEL = "chat-model"
SECRET = "sk-live-0123456789abcdefghij"


@dataclass
class Served:
    url: str
    keys: dict[str, str]  # project -> an invoke + usage:read key; "ops": an admin key
    store: str

    def admin(self, method: str, path: str, key: str = "ops", **kwargs: Any) -> httpx.Response:
        return httpx.request(method, self.url + "/admin/v1" + path,
                             headers={"authorization": f"Bearer {self.keys[key]}"}, **kwargs)

    def logs(self, project: str = "default", key: str = "ops", **params: Any) -> list[Any]:
        response = self.admin("GET", f"/projects/{project}/request-logs", key=key, params=params)
        assert response.status_code == 200, response.text
        return list(response.json()["data"])


async def _keys(data_dir: Path, redis_url: str | None) -> dict[str, str]:
    from auth import AuthSettings, open_auth

    services = await open_auth(AuthSettings(data_dir=data_dir, redis_url=redis_url))
    try:
        keys = {}
        for project in ("default", "other", "ops"):
            await services.admin.create_project(project)
            scopes = (["ai_gateway:admin"] if project == "ops"
                      else ["ai_gateway:invoke", "ai_gateway:usage:read"])
            _, keys[project] = await services.admin.create_key(project, scopes)
        return keys
    finally:
        await services.close()


@pytest.fixture(params=["sqlite", "redis"])
def served(request: pytest.FixtureRequest, loop_thread: LoopThread, tmp_path: Path
           ) -> Iterator[Served]:
    redis_url = request.getfixturevalue("clean_redis_url") if request.param == "redis" else None
    upstream, upstream_url = loop_thread.run(start_app(create_scripted_upstream([])))
    keys = loop_thread.run(_keys(tmp_path, redis_url))
    settings = GatewaySettings(
        data_dir=tmp_path, redis_url=redis_url,
        models=[{"name": name, "backend": "openai", "endpoints": [upstream_url],
                 "context_length": 4096,
                 "prices": {"input_per_token": 1e-6, "output_per_token": 2e-6}}
                for name in (MODEL, "other-model")],
        request_logs={"projects": {"default": {"sample_rate": 1.0}},
                      "redact_fields": ["request.metadata.email"], "settings_refresh_s": 0.2})
    app = loop_thread.run(create_served_app(settings))
    runner, url = loop_thread.run(start_app(app))
    try:
        yield Served(url, keys, request.param)
    finally:
        loop_thread.run(runner.cleanup())
        loop_thread.run(upstream.cleanup())


def _chat(served: Served, project: str = "default", model: str = MODEL, text: str = "hi",
          **extra: Any) -> httpx.Response:
    response = httpx.post(served.url + "/v1/chat/completions",
                          headers={"authorization": f"Bearer {served.keys[project]}"},
                          json={"model": model, "messages": [{"role": "user", "content": text}],
                                **extra})
    assert response.status_code == 200, response.text
    return response


def test_entries_hold_bodies_usage_cost_latency_and_trace_id_with_secrets_redacted(
        served: Served) -> None:
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=served.keys["default"],
                           max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": f"SAY:my key is {SECRET}"}],
        metadata={"email": "jo@example.com", "team": "search"}, extra_headers={"x-api-key": "k"})
    completion = raw.parse()
    with anthropic.Anthropic(base_url=served.url + "/anthropic", api_key=served.keys["default"],
                             max_retries=0).messages.stream(
            model=MODEL, max_tokens=20, messages=[{"role": "user", "content": "SAY:streamed"}]
            ) as stream:
        assert "".join(stream.text_stream) == "streamed"
    entries = served.logs()
    assert [e["path"] for e in entries] == ["/anthropic/v1/messages", "/v1/chat/completions"]
    entry = entries[1]
    assert entry["trace_id"] == raw.headers["x-aigw-trace-id"]
    assert entry["request_id"] == raw.headers["x-request-id"] and entry["status"] == 200
    assert completion.usage is not None
    assert entry["usage"]["prompt_tokens"] == completion.usage.prompt_tokens
    assert entry["usage"]["completion_tokens"] == completion.usage.completion_tokens
    assert entry["cost_usd"] == pytest.approx(completion.usage.prompt_tokens * 1e-6
                                              + completion.usage.completion_tokens * 2e-6)
    assert entry["latency_ms"] > 0 and entry["model"] == MODEL and entry["project"] == "default"
    assert entry["headers"]["authorization"] == REDACTED
    assert entry["headers"]["x-api-key"] == REDACTED
    assert entry["request"]["metadata"] == {"email": REDACTED, "team": "search"}
    assert entry["request"]["messages"][0]["content"] == f"SAY:my key is {REDACTED}"
    assert entry["response"]["choices"][0]["message"]["content"] == f"my key is {REDACTED}"
    assert SECRET not in str(entries) and served.keys["default"] not in str(entries)
    assert entries[0]["stream"] is True  # a stream's answer as its events added up
    assert entries[0]["response"]["content"][0]["text"] == "streamed"
    # filters and pages
    assert [e["id"] for e in served.logs(trace_id=entry["trace_id"])] == [entry["id"]]
    assert [e["id"] for e in served.admin("GET", "/request-logs",
                                          params={"trace_id": entry["trace_id"]}).json()["data"]
            ] == [entry["id"]]
    _chat(served, model="other-model")
    assert [e["model"] for e in served.logs(model="other-model")] == ["other-model"]
    assert served.logs(since=time.time() + 60) == []
    assert len(served.logs(until=entry["created_at"] + 1e-3)) == 1
    first = served.admin("GET", "/projects/default/request-logs", params={"limit": 2}).json()
    rest = served.logs(cursor=first["next_cursor"], limit=2)
    assert [e["id"] for e in first["data"] + rest] == [e["id"] for e in served.logs()]
    assert len(rest) == 1
    bad = served.admin("GET", "/projects/default/request-logs", params={"since": "yesterday"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"
    for cursor in ("²", "9" * 5000):  # isdigit() takes both; Redis then refused it (503)
        bad = served.admin("GET", "/projects/default/request-logs", params={"cursor": cursor})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"


def test_logs_are_opt_in_tenant_scoped_and_switched_through_the_admin_api(
        served: Served) -> None:
    _chat(served, project="other")
    assert served.logs("other") == []  # not opted in
    _chat(served)
    own = served.logs(key="default")  # a project's usage:read key reads its own logs
    assert len(own) == 1
    refused = served.admin("GET", "/projects/default/request-logs", key="other")
    assert refused.status_code == 403
    assert served.admin("GET", "/request-logs", key="default",
                        params={"trace_id": own[0]["trace_id"]}).status_code == 403
    assert served.admin("PUT", "/projects/other/request-log-settings", key="other",
                        json={"enabled": True}).status_code == 403
    put = served.admin("PUT", "/projects/other/request-log-settings",
                       json={"enabled": True, "sample_rate": 1.0})
    assert put.json() == {"project": "other", "enabled": True, "sample_rate": 1.0}
    _chat(served, project="other")
    assert len(served.logs("other")) == 1
    served.admin("PUT", "/projects/default/request-log-settings", json={"enabled": False})
    _chat(served)
    assert len(served.logs()) == 1
    served.admin("DELETE", "/projects/default/request-log-settings")  # back to the config's
    _chat(served)
    assert len(served.logs()) == 2
    assert served.admin("PUT", "/projects/other/request-log-settings",
                        json={"sample_rate": 2}).status_code == 400
    for coerced in ({"enabled": "yes"}, {"enabled": 1}, {"sample_rate": "1"}):  # not JSON's types
        refused = served.admin("PUT", "/projects/default/request-log-settings", json=coerced)
        assert refused.status_code == 400, (coerced, refused.text)
        assert "validation error" not in refused.json()["error"]["message"]  # one line a field
    assert served.admin("GET", "/projects/default/request-log-settings").json()["enabled"] is True


def test_sampling_keeps_about_the_rate_asked() -> None:
    settings = RequestLogSettings(projects={"p": {"sample_rate": 0.25}, "q": {"enabled": False}})
    request_log = RequestLog(settings, store=None)  # type: ignore[arg-type]
    request_log._random = random.Random(7).random
    num_kept = sum(request_log.sample("p") for _ in range(20_000))
    assert abs(num_kept - 5000) < 4 * (20_000 * 0.25 * 0.75) ** 0.5  # within 4 sigma
    assert not any(request_log.sample(name) for name in ("q", "unknown") for _ in range(100))


def _capture(body: Any, created_at: float, project: str = "p") -> Capture:
    from gateway.dialects.openai_chat import OpenAIChat
    from gateway.request.canonical import CanonicalRequest

    record = UsageRecord(request_id=f"r{random.random()}", project=project, key_id="k",
                         model="m", endpoint="e", prompt_tokens=1, cached_tokens=0,
                         completion_tokens=1, cost_usd=0.0, latency_ms=1.0, status=200,
                         created_at=created_at, stream=False, finish_reason="stop")
    return Capture(body=body, headers=[], path="/v1/chat/completions", dialect=OpenAIChat(),
                   request=CanonicalRequest("r", "m"), response=None, error=None, record=record,
                   trace_id=None, weight_bytes=100)


def test_an_entry_is_cut_to_max_entry_bytes_with_its_metadata_whole() -> None:
    huge = {"messages": [{"role": "user", "content": "é" * 50_000 + "\"" * 10_000}]}
    entry = build_entry(_capture(huge, time.time()), 4096, ())
    assert entry.num_bytes <= 4096
    import orjson

    parsed = orjson.loads(entry.data)
    assert parsed["truncated"] is True and parsed["usage"]["prompt_tokens"] == 1
    assert parsed["request"]["text"].startswith('{"messages"')


@pytest.mark.parametrize("kind", ["sqlite", "redis", "cluster"])
def test_stores_hold_a_project_within_its_byte_bound_and_drop_what_is_past_retention(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    async def run() -> None:
        entry_bytes = 4096
        if kind != "sqlite":
            from infra.redis_client import connect_redis

            client = connect_redis(request.getfixturevalue(
                "clean_redis_url" if kind == "redis" else "clean_redis_cluster_url"),
                decode_responses=True)
            store: Any = RedisLogStore(client, retention_s=1.0, max_entries=40_960 // entry_bytes)
        else:
            store = await SqliteLogStore.open(tmp_path, retention_s=1.0, max_project_bytes=40_960)
        try:
            now = time.time()
            for _ in range(30):
                entry = build_entry(_capture({"x": "y" * 3500}, now), entry_bytes, ())
                await store.append([entry, LogEntry(entry.id + "q", "q", "m", None, now,
                                                    b'{"id": "small"}')], now)
            kept, _ = await store.query(LogQuery("p", limit=200))
            assert 5 <= len(kept) <= 20  # ~40 KiB of ~3.6 KiB entries (Redis trims ~)
            if kind == "sqlite":
                assert sum(len(str(e)) for e in kept) <= 40_960
            assert len((await store.query(LogQuery("q", limit=200)))[0]) == 30  # its own bound
            await asyncio.sleep(1.1)
            await store.trim(time.time())
            assert (await store.query(LogQuery("p")))[0] == []
            fresh = build_entry(_capture({}, time.time()), entry_bytes, ())
            await store.append([fresh], time.time())
            assert [e["id"] for e in (await store.query(LogQuery("p")))[0]] == [fresh.id]
            if kind != "sqlite":
                assert await client.xlen("aigw:{p:p}:reqlog") <= 2  # MINID trimmed the old ones
                trace = build_entry(_capture({}, time.time()), entry_bytes, ())
                traced = LogEntry(trace.id, "q", "m", "ab" * 16, trace.created_at, trace.data)
                await store.append([traced], time.time())  # (the trace index: another slot)
                found, _ = await store.query(LogQuery(None, trace_id="ab" * 16))
                assert [e["id"] for e in found] == [trace.id]
        finally:
            await store.close()
            if kind != "sqlite":
                await client.aclose()

    asyncio.run(run())


def test_a_full_queue_drops_and_counts_and_a_pii_guard_masks_the_logged_body_too(
        loop_thread: LoopThread, tmp_path: Path) -> None:
    upstream, upstream_url = loop_thread.run(start_app(create_scripted_upstream([])))
    keys = loop_thread.run(_keys(tmp_path, None))
    settings = GatewaySettings(
        data_dir=tmp_path, models=[{"name": MODEL, "backend": "openai",
                                    "endpoints": [upstream_url], "context_length": 100_000}],
        request_logs={"projects": {"default": {}}, "queue_max_bytes": 2048},
        guardrails=[{"name": "pii", "type": "pii", "stages": ["request"]}])
    app = loop_thread.run(create_served_app(settings))
    runner, url = loop_thread.run(start_app(app))
    try:
        served = Served(url, keys, "sqlite")
        _chat(served, text="small, mail jo@example.com")
        assert _chat(served, text="x" * 8000).status_code == 200  # over the queue's bound
        assert wait_until(lambda: 'aigw_request_logs_dropped_total{reason="queue_full"} 1.0'
                          in httpx.get(url + "/metrics", headers={
                              "authorization": f"Bearer {keys['ops']}"}).text)
        assert [e["request"]["messages"][0]["content"] for e in served.logs()] == [
            "small, mail [EMAIL]"]
    finally:
        loop_thread.run(runner.cleanup())
        loop_thread.run(upstream.cleanup())


def test_a_setting_made_on_one_gateway_reaches_another_on_the_same_redis(
        loop_thread: LoopThread, tmp_path: Path, clean_redis_url: str) -> None:
    upstream, upstream_url = loop_thread.run(start_app(create_scripted_upstream([])))
    keys = loop_thread.run(_keys(tmp_path, clean_redis_url))
    settings = GatewaySettings(
        data_dir=tmp_path, redis_url=clean_redis_url,
        models=[{"name": MODEL, "backend": "openai", "endpoints": [upstream_url],
                 "context_length": 4096}],
        request_logs={"settings_refresh_s": 0.2})
    runners = [loop_thread.run(start_app(loop_thread.run(create_served_app(settings))))
               for _ in range(2)]
    try:
        first, second = (Served(url, keys, "redis") for _, url in runners)
        _chat(second)
        assert first.logs() == []  # not opted in
        assert first.admin("PUT", "/projects/default/request-log-settings",
                           json={"sample_rate": 1.0}).status_code == 200
        started = time.monotonic()
        while time.monotonic() - started < 5:
            _chat(second, text="after")
            if first.logs():
                break
            time.sleep(0.1)
        assert time.monotonic() - started < 1.5  # within settings_refresh_s and a request
        assert first.logs()[0]["request"]["messages"][0]["content"] == "after"
    finally:
        for runner, _ in runners:
            loop_thread.run(runner.cleanup())
        loop_thread.run(upstream.cleanup())
