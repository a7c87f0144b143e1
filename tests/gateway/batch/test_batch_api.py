"""The Batch API on a mock replica, through the openai SDK and raw HTTP, with auth and the
embedded meter on (two projects): the flow to completed with the custom_id mapping, the batch
price in the ledger, malformed lines in the error file, cancel, isolation between projects,
bounds, pagination, and interactive traffic first."""

from __future__ import annotations

import io
import re
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from auth import AuthSettings, open_auth
from auth.principal import Scope
from bench.mock_upstream import MockConfig, MockState, create_mock_app
from gateway.settings import GatewaySettings
from gateway.web.services import create_served_app
from tests.gateway.conftest import MODEL, LoopThread, start_app, wait_until

PRICES = {"input_per_token": 1e-6, "cached_input_per_token": 1e-7, "output_per_token": 2e-6}
DISCOUNT = 0.5
BLOCKED_WORD = "project-bluebird"


@dataclass
class Served:
    url: str
    key: str  # project "default"
    other_key: str  # project "other"
    state: MockState
    data_dir: Path
    restricted_key: str  # project "default", invoke, only the model "another-model"
    read_only_key: str  # project "default", usage:read only

    def client(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key or self.key, max_retries=0,
                             timeout=30)

    def ledger(self, prefix: str) -> list[tuple[str, int, int, int]]:
        """(record id, prompt, completion, cost in nanos) of the usage rows under `prefix`."""
        with sqlite3.connect(self.data_dir / "aigw.sqlite3") as conn:
            return conn.execute("SELECT request_id, prompt_tokens, completion_tokens, cost_nanos "
                                "FROM usage WHERE request_id LIKE ? ORDER BY request_id",
                                (prefix + "%",)).fetchall()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    loop_thread = LoopThread()
    data_dir = tmp_path_factory.mktemp("batch-api")
    state = MockState(MockConfig(model=MODEL, num_tokens=4))
    upstream, upstream_url = loop_thread.run(start_app(create_mock_app(state)))
    guardrails = [{"name": "no-secret", "type": "regex", "stages": ["request"],
                   "options": {"words": [BLOCKED_WORD]}}]
    settings = GatewaySettings(
        guardrails=guardrails, data_dir=data_dir, health_interval_s=0.2,
        batch={"max_file_bytes": 64 * 1024, "max_lines": 50, "poll_interval_s": 0.1,
               "price_discount": DISCOUNT, "max_concurrent_lines": 2},
        models=[{"name": MODEL, "backend": "replica", "endpoints": [upstream_url],
                 "prices": PRICES}])
    key, other, restricted, read_only = loop_thread.run(project_keys(data_dir, "default", "other"))
    runner, url = loop_thread.run(start_app(loop_thread.run(create_served_app(settings))))
    try:
        yield Served(url, key, other, state, data_dir, restricted, read_only)
    finally:
        loop_thread.run(runner.cleanup())
        loop_thread.run(upstream.cleanup())
        loop_thread.close()


async def project_keys(data_dir: Path, *projects: str) -> list[str]:
    """An invoke key of each project (created in the key store before the gateway opens it)."""
    auth = await open_auth(AuthSettings(enabled=True, data_dir=data_dir))
    try:
        keys = []
        for project in projects:
            await auth.admin.create_project(project)
            keys.append((await auth.admin.create_key(project, [Scope.INVOKE.value]))[1])
        keys.append((await auth.admin.create_key(projects[0], [Scope.INVOKE.value],
                                                 allowed_models=["another-model"]))[1])
        keys.append((await auth.admin.create_key(projects[0], [Scope.USAGE_READ.value]))[1])
        return keys
    finally:
        await auth.close()


def chat_line(custom_id: str, content: str, system: str = "You are terse.",
              model: str = MODEL) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "max_tokens": 4,
                     "messages": [{"role": "system", "content": system},
                                  {"role": "user", "content": content}]}}


def jsonl(lines: list[Any]) -> bytes:
    return b"".join((line if isinstance(line, bytes) else orjson.dumps(line)) + b"\n"
                    for line in lines)


def wait_done(client: openai.OpenAI, batch_id: str, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} still {batch.status}")


def submit(client: openai.OpenAI, lines: list[Any], endpoint: str = "/v1/chat/completions") -> Any:
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=endpoint,  # type: ignore[arg-type]
                                 completion_window="24h", metadata={"job": "test"})


def read_jsonl(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    return [orjson.loads(line) for line in client.files.content(file_id).content.splitlines()]


def test_the_sdk_flow_maps_custom_ids_and_meters_each_line_once_at_the_batch_price(
        served: Served) -> None:
    client = served.client()
    lines = [chat_line(f"q-{i}", f"question {i}") for i in range(6)]
    batch = submit(client, lines)
    assert batch.status == "validating" and batch.metadata == {"job": "test"}
    done = wait_done(client, batch.id)
    assert done.status == "completed" and done.completed_at and done.in_progress_at
    assert done.request_counts.total == 6 and done.request_counts.completed == 6
    assert done.request_counts.failed == 0 and done.error_file_id is None
    outputs = read_jsonl(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in outputs) == sorted(f"q-{i}" for i in range(6))
    for output in outputs:
        body = output["response"]["body"]
        assert output["response"]["status_code"] == 200 and output["error"] is None
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
    assert done.usage.output_tokens == sum(o["response"]["body"]["usage"]["completion_tokens"]
                                           for o in outputs)
    questions = {f"question {i}" for i in range(6)}
    sent = [b for b in served.state.bodies
            if b.get("messages", [{}])[-1].get("content") in questions]
    assert len(sent) >= 6 and all(b.get("priority") == 1 for b in sent)  # lines run as flex
    ledger = served.ledger(batch.id + "/")
    assert [row[0] for row in ledger] == [f"{batch.id}/{i}" for i in range(6)]
    for _, prompt, completion, cost_nanos in ledger:  # the interactive price, halved
        full = prompt * PRICES["input_per_token"] + completion * PRICES["output_per_token"]
        assert cost_nanos == round(full * (1 - DISCOUNT) * 1e9)
    info = client.files.retrieve(done.output_file_id)
    assert info.purpose == "batch_output" and info.bytes > 0
    metrics = httpx.get(served.url + "/metrics").text
    completed = re.search(r'^aigw_batch_lines_total\{outcome="completed"\} (\S+)$', metrics, re.M)
    assert completed and float(completed.group(1)) >= 6
    assert re.search(r"^aigw_batch_lines_running 0\.0$", metrics, re.M)


def test_malformed_lines_and_refused_requests_go_to_the_error_file(served: Served) -> None:
    client = served.client()
    lines: list[Any] = [
        chat_line("good", "hi"), b"{not json", orjson.dumps({"method": "POST"}),
        chat_line("good", "again"),  # a repeated custom_id
        {**chat_line("wrong-url", "hi"), "url": "/v1/completions"},
        {**chat_line("stream", "hi"), "body": {**chat_line("s", "x")["body"], "stream": True}},
        chat_line("no-model", "hi", model="no-such-model"),
        {**chat_line("bad-body", "hi"), "body": {"model": MODEL, "messages": "not a list"}}]
    done = wait_done(client, submit(client, lines).id)
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (8, 1, 7)
    errors = {(e["custom_id"], e["error"]["code"] if e["error"] else e["response"]["status_code"])
              for e in read_jsonl(client, done.error_file_id)}
    assert errors == {(None, "invalid_json_line"), (None, "missing_custom_id"),
                      ("good", "duplicate_custom_id"), ("wrong-url", "mismatched_endpoint"),
                      ("stream", "stream_not_supported"), ("no-model", 404), ("bad-body", 400)}
    refused = [e for e in read_jsonl(client, done.error_file_id) if e["response"]]
    assert all(e["response"]["body"]["error"]["message"] for e in refused)
    (unknown,) = [e for e in refused if e["custom_id"] == "no-model"]  # where the names are
    assert "GET /v1/models" in unknown["response"]["body"]["error"]["message"]
    assert [o["custom_id"] for o in read_jsonl(client, done.output_file_id)] == ["good"]


def test_a_batch_with_no_lines_fails_and_a_cancel_of_a_finished_one_is_refused(
        served: Served) -> None:
    client = served.client()
    uploaded = client.files.create(file=("blank.jsonl", io.BytesIO(b"\n \n")), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    failed = wait_done(client, batch.id)
    assert failed.status == "failed" and failed.errors.data[0].code == "empty_file"
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_cancel_stops_the_batch_with_the_finished_lines_kept(served: Served) -> None:
    client = served.client()
    served.state.config.latency_ms = 150.0
    try:
        batch = submit(client, [chat_line(f"c-{i}", f"slow {i}") for i in range(30)])
        deadline = time.monotonic() + 10
        while client.batches.retrieve(batch.id).request_counts.completed < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        cancelling = client.batches.cancel(batch.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at
        done = wait_done(client, batch.id)
    finally:
        served.state.config.latency_ms = 0.0
    assert done.status == "cancelled" and done.cancelled_at
    assert 1 <= done.request_counts.completed < 30
    outputs = read_jsonl(client, done.output_file_id)
    assert len(outputs) == done.request_counts.completed
    assert len(served.ledger(batch.id + "/")) == done.request_counts.completed


def test_another_projects_key_sees_none_of_it(served: Served) -> None:
    mine, theirs = served.client(), served.client(served.other_key)
    done = wait_done(mine, submit(mine, [chat_line("x", "hi")]).id)
    for call in (lambda: theirs.batches.retrieve(done.id),
                 lambda: theirs.batches.cancel(done.id),
                 lambda: theirs.files.retrieve(done.input_file_id),
                 lambda: theirs.files.content(done.output_file_id),
                 lambda: theirs.files.delete(done.input_file_id),
                 lambda: theirs.batches.create(input_file_id=done.input_file_id,
                                               endpoint="/v1/chat/completions",
                                               completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert theirs.batches.list().data == [] and theirs.files.list().data == []
    assert mine.files.retrieve(done.input_file_id).id == done.input_file_id
    assert mine.files.delete(done.input_file_id).deleted
    with pytest.raises(openai.NotFoundError):
        mine.files.retrieve(done.input_file_id)


def test_lists_page_newest_first(served: Served) -> None:
    client = served.client()
    ids = [submit(client, [chat_line("p", "hi")]).id for _ in range(3)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    rest = client.batches.list(limit=2, after=first.data[-1].id)
    assert rest.data[0].id == ids[0]
    everything = [b.id for b in client.batches.list(limit=1)]  # the SDK follows the pages
    assert everything[:3] == ids[::-1] and len(everything) == len(set(everything))
    for batch_id in ids:
        wait_done(client, batch_id)


@pytest.mark.parametrize(("call", "status", "code"), [
    ("big", 413, "file_too_large"), ("lines", 400, "too_many_lines"),
    ("purpose", 400, "invalid_request"), ("form", 400, "invalid_request"),
    ("endpoint", 400, "invalid_request"), ("window", 400, "invalid_request"),
    ("metadata", 400, "invalid_request"), ("no-key", 401, None), ("limit", 400, "invalid_request"),
    ("broken", 400, "invalid_request"), ("no-boundary", 400, "invalid_request"),
    ("empty", 400, "invalid_request"), ("window-list", 400, "invalid_request"),
    ("endpoint-object", 400, "invalid_request"),
])
def test_bad_requests_get_openai_errors(served: Served, call: str, status: int,
                                        code: str | None) -> None:
    headers = {"authorization": f"Bearer {served.key}"}
    url = served.url + "/v1"
    uploaded = served.client().files.create(file=("x.jsonl",
                                                  io.BytesIO(jsonl([chat_line("a", "b")]))),
                                            purpose="batch")
    create = {"input_file_id": uploaded.id, "endpoint": "/v1/chat/completions",
              "completion_window": "24h"}
    response = {
        "big": lambda: httpx.post(url + "/files", headers=headers, data={"purpose": "batch"},
                                  files={"file": ("a.jsonl", b"x" * (65 * 1024))}),
        "lines": lambda: httpx.post(url + "/files", headers=headers, data={"purpose": "batch"},
                                    files={"file": ("a.jsonl", b"{}\n" * 51)}),
        "purpose": lambda: httpx.post(url + "/files", headers=headers,
                                      data={"purpose": "fine-tune"},
                                      files={"file": ("a.jsonl", b"{}\n")}),
        "form": lambda: httpx.post(url + "/files", headers=headers, json={"purpose": "batch"}),
        "endpoint": lambda: httpx.post(url + "/batches", headers=headers,
                                       json={**create, "endpoint": "/v1/images/generations"}),
        "window": lambda: httpx.post(url + "/batches", headers=headers,
                                     json={**create, "completion_window": "1h"}),
        "metadata": lambda: httpx.post(url + "/batches", headers=headers,
                                       json={**create, "metadata": {"k": 1}}),
        "no-key": lambda: httpx.get(url + "/batches"),
        "limit": lambda: httpx.get(url + "/batches?limit=0", headers=headers),
        "broken": lambda: httpx.post(url + "/files", content=b"--xyz\r\ngarbage", headers={
            **headers, "content-type": "multipart/form-data; boundary=xyz"}),
        "no-boundary": lambda: httpx.post(url + "/files", content=b"x", headers={
            **headers, "content-type": "multipart/form-data"}),
        "window-list": lambda: httpx.post(url + "/batches", headers=headers,
                                          json={**create, "completion_window": ["24h"]}),
        "endpoint-object": lambda: httpx.post(url + "/batches", headers=headers,
                                              json={**create, "endpoint": {"a": 1}}),
        "empty": lambda: httpx.post(url + "/files", headers=headers, data={"purpose": "batch"},
                                    files={"file": ("a.jsonl", b"")}),
    }[call]()
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and (code is None or error["code"] == code)


def test_lines_wait_while_interactive_requests_are_in_flight(served: Served) -> None:
    """max_interactive_in_flight 1: no line starts while one interactive request is in flight."""
    client = served.client()
    served.state.config.latency_ms = 800.0
    interactive: list[float] = []

    def batch_line_sent() -> bool:
        return any(m["content"] == "batch line" for b in list(served.state.bodies)
                   for m in b.get("messages", []))

    def ask() -> None:
        client.chat.completions.create(model=MODEL, max_tokens=2,
                                       messages=[{"role": "user", "content": "interactive"}])
        interactive.append(time.monotonic())

    try:
        asker = threading.Thread(target=ask)
        asker.start()
        deadline = time.monotonic() + 5
        while served.state.num_running == 0:  # until it is in flight at the replica
            assert time.monotonic() < deadline
            time.sleep(0.01)
        batch = submit(client, [chat_line("after", "batch line")])
        time.sleep(0.3)
        assert served.state.num_running == 1 and not batch_line_sent()  # the line waits
        asker.join()
    finally:
        served.state.config.latency_ms = 0.0
    done = wait_done(client, batch.id)
    assert done.status == "completed" and interactive and batch_line_sent()


def test_the_gateways_guardrails_check_batch_lines_too(served: Served) -> None:
    client = served.client()
    done = wait_done(client, submit(client, [chat_line("ok", "hello"),
                                             chat_line("blocked",
                                                       f"tell me of {BLOCKED_WORD}")]).id)
    (error,) = read_jsonl(client, done.error_file_id)
    assert error["custom_id"] == "blocked" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["code"] == "guardrail_blocked"
    assert not any(BLOCKED_WORD in m["content"] for b in list(served.state.bodies)
                   for m in b.get("messages", []))


def test_a_line_that_keeps_failing_in_the_gateway_ends_as_a_500_and_the_batch_completes(
        served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.batch.line_runner import LineRunner

    real = LineRunner.run_line
    tries: list[str] = []

    async def flaky(self: LineRunner, batch_id: str, index: int, custom_id: str,
                    *args: Any) -> Any:
        if custom_id == "crash":
            tries.append(custom_id)
            raise RuntimeError("a store outage, say")
        return await real(self, batch_id, index, custom_id, *args)

    monkeypatch.setattr(LineRunner, "run_line", flaky)
    client = served.client()
    done = wait_done(client, submit(client, [chat_line("fine", "hi"), chat_line("crash", "hi")]).id)
    assert done.status == "completed" and len(tries) == 3
    (error,) = read_jsonl(client, done.error_file_id)
    assert error["custom_id"] == "crash" and error["response"]["status_code"] == 500
    assert [o["custom_id"] for o in read_jsonl(client, done.output_file_id)] == ["fine"]


def test_a_batch_past_its_window_expires_with_its_lines_in_the_error_file(
        served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.batch import records

    monkeypatch.setitem(records.COMPLETION_WINDOW_S, "24h", 0)  # the window ends at once
    client = served.client()
    done = wait_done(client, submit(client, [chat_line(f"e-{i}", "hi") for i in range(3)]).id)
    assert done.status == "expired" and done.expired_at and done.output_file_id is None
    errors = read_jsonl(client, done.error_file_id)
    assert sorted(e["custom_id"] for e in errors) == ["e-0", "e-1", "e-2"]
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert done.request_counts.failed == 3


def test_batches_take_turns_so_a_long_one_does_not_hold_a_short_one_back(
        served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.batch import runner

    monkeypatch.setattr(runner, "_TURN_S", 0.2)
    served.state.config.latency_ms = 100.0
    client = served.client()
    try:
        long = submit(client, [chat_line(f"l-{i}", f"long {i}") for i in range(40)])
        deadline = time.monotonic() + 10
        while client.batches.retrieve(long.id).request_counts.completed < 2:  # it is running
            assert time.monotonic() < deadline
            time.sleep(0.02)
        short = wait_done(client, submit(client, [chat_line("s", "short")]).id)
        assert short.status == "completed"
        assert client.batches.retrieve(long.id).request_counts.completed < 30  # far from done
        assert wait_done(client, long.id).request_counts.completed == 40
    finally:
        served.state.config.latency_ms = 0.0


def test_hostile_multipart_bodies_get_a_4xx_never_a_5xx(served: Served) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    valid = (b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--b\r\n'
             b'Content-Disposition: form-data; name="file"; filename="x.jsonl"\r\n\r\n{}\n\r\n'
             b'--b--\r\n')
    headers = {"authorization": f"Bearer {served.key}",
               "content-type": "multipart/form-data; boundary=b"}

    @settings(max_examples=40, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(cut=st.integers(0, len(valid)), junk=st.binary(max_size=40))
    def upload(cut: int, junk: bytes) -> None:
        answer = http.post(served.url + "/v1/files", content=valid[:cut] + junk, headers=headers)
        assert answer.status_code < 500, answer.text
        if answer.status_code >= 400:
            assert answer.json()["error"]["message"]

    with httpx.Client(timeout=10) as http:
        assert http.post(served.url + "/v1/files", content=valid,
                         headers=headers).status_code == 200  # the uncut body is fine
        upload()


def test_a_keys_scope_and_models_hold_for_its_batches(served: Served) -> None:
    with pytest.raises(openai.PermissionDeniedError):  # usage:read only: no files, no batches
        served.client(served.read_only_key).batches.list()
    restricted = served.client(served.restricted_key)
    done = wait_done(restricted, submit(restricted, [chat_line("x", "hi")]).id)
    (error,) = read_jsonl(restricted, done.error_file_id)  # the line runs with the key's rights
    assert error["response"]["status_code"] == 403
    assert error["response"]["body"]["error"]["code"] == "model_not_allowed"


def test_create_bodies_of_any_json_get_a_4xx_never_a_5xx(served: Served) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    anything = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=10),
                            lambda inner: st.lists(inner, max_size=3)
                            | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                            max_leaves=6)
    bodies = st.fixed_dictionaries({}, optional={
        "input_file_id": anything, "endpoint": anything | st.just("/v1/chat/completions"),
        "completion_window": anything | st.just("24h"), "metadata": anything})

    @settings(max_examples=40, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=bodies)
    def create(body: dict[str, Any]) -> None:
        answer = http.post(served.url + "/v1/batches", json=body,
                           headers={"authorization": f"Bearer {served.key}"})
        assert 400 <= answer.status_code < 500, answer.text
        assert answer.json()["error"]["message"]

    with httpx.Client(timeout=10) as http:
        create()


def test_revoking_the_creating_key_stops_the_lines_not_yet_run(served: Served) -> None:
    """A batch ran every line with the rights its key had at creation: a key revoked as
    compromised kept spending its project's budget for up to the 24 h window."""
    import asyncio

    async def create_key() -> tuple[str, str]:
        auth = await open_auth(AuthSettings(enabled=True, data_dir=served.data_dir))
        try:
            record, secret = await auth.admin.create_key("default", [Scope.INVOKE.value])
            return record.key_id, secret
        finally:
            await auth.close()

    async def revoke(key_id: str) -> None:
        auth = await open_auth(AuthSettings(enabled=True, data_dir=served.data_dir))
        try:
            await auth.admin.revoke_key(key_id)
        finally:
            await auth.close()

    key_id, key = asyncio.run(create_key())
    client = served.client(key)
    num_seen = len(served.state.request_ids)
    served.state.config.latency_ms = 1500  # the first lines wait at the upstream
    try:
        batch = submit(client, [chat_line(f"r-{i}", "hi") for i in range(6)])
        assert wait_until(lambda: len(served.state.request_ids) > num_seen, 10)
        asyncio.run(revoke(key_id))
        assert wait_until(lambda: httpx.get(served.url + "/v1/models", headers={
            "authorization": f"Bearer {key}"}).status_code == 401, 5)
    finally:
        served.state.config.latency_ms = 0
    done = wait_done(served.client(), batch.id)  # (another key of the project reads it)
    errors = read_jsonl(served.client(), done.error_file_id)
    assert done.request_counts is not None and done.request_counts.completed <= 2  # in flight
    assert len(errors) >= 4 and {e["response"]["status_code"] for e in errors} == {401}
    assert {e["response"]["body"]["error"]["code"] for e in errors} == {"revoked_api_key"}


def test_uploads_in_flight_count_against_the_projects_bytes(make_gateway: Any,
                                                           tmp_path: Path) -> None:
    """Only a finished upload was checked against batch.max_project_bytes, each alone: a
    project's concurrent uploads all streamed to disk (max_file_bytes each) before any was
    checked. Now an upload's bytes count while they stream: a second upload that would take
    the project over its bound with the first still in flight is refused."""
    import socket

    from gateway.web.keys import BATCH

    kib = 1024
    gateway = make_gateway(data_dir=tmp_path, batch={"max_file_bytes": 64 * kib,
                                                     "max_project_bytes": 100 * kib})
    uploads = gateway.app[BATCH].uploads

    def upload(num_bytes: int) -> httpx.Response:
        return httpx.post(gateway.url + "/v1/files", data={"purpose": "batch"},
                          files={"file": ("b.jsonl", b"{}\n" * (num_bytes // 3))}, timeout=10)

    head = (b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--b\r\n'
            b'Content-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n')
    content, line, tail = b"{}\n" * (50 * kib // 3), b"{}\n" * 10, b"\r\n--b--\r\n"
    host, port = gateway.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as slow:
        slow.sendall(b"POST /v1/files HTTP/1.1\r\nHost: t\r\nConnection: close\r\n"
                     b"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: %d\r\n"
                     b"\r\n" % len(head + content + line + tail) + head + content)
        time.sleep(0.2)
        slow.sendall(line)  # (aiohttp hands on a part's chunk once the next one has come)
        assert wait_until(lambda: uploads.in_flight("anonymous") >= len(content))
        refused = upload(60 * kib)  # 50 KiB in flight + 60 KiB: over 100 KiB
        assert refused.status_code == 413, refused.text
        assert refused.json()["error"]["code"] == "storage_limit_exceeded"
        slow.sendall(tail)
        answer = b""
        while chunk := slow.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    assert uploads.in_flight("anonymous") == 0  # released, stored
    assert upload(60 * kib).status_code == 413  # 50 KiB stored + 60 KiB
    assert upload(40 * kib).status_code == 200  # the refused one's bytes were released
    assert uploads.in_flight("anonymous") == 0
    assert not list((tmp_path / "batch-files").glob("*.part"))


def test_a_projects_unfinished_batches_are_bounded(make_gateway: Any, loop_thread: LoopThread,
                                                  tmp_path: Path) -> None:
    """Batches were created without bound: every gateway's runner polls each active batch, so
    one project's thousands of waiting batches slowed everyone's. batch.max_active_batches
    bounds a project's unfinished ones (429 too_many_active_batches past it); another
    project's are its own, and a finished one makes room."""
    from auth.principal import Principal
    from gateway.batch.records import BatchStatus
    from gateway.web.keys import BATCH

    class TwoProjects:
        async def authenticate(self, credential: str | None) -> Principal:
            return Principal(str(credential), "k-" + str(credential),
                             frozenset({Scope.INVOKE.value}))

    gateway = make_gateway(data_dir=tmp_path, authenticator=TwoProjects(),
                           batch={"max_active_batches": 2})

    def create(project: str) -> Any:
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=project, max_retries=0)
        uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl([chat_line("a", "b")]))),
                                       purpose="batch")
        return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                     completion_window="24h")

    openai.OpenAI(base_url=gateway.url + "/v1", api_key="alpha").batches.list()  # (opens it)
    service = gateway.app[BATCH]
    loop_thread.run(service.runner.close())  # nothing advances: every batch stays unfinished
    first = create("alpha")
    create("alpha")
    with pytest.raises(openai.RateLimitError) as refused:
        create("alpha")
    assert refused.value.code == "too_many_active_batches"
    create("beta")  # another project's count
    record = loop_thread.run(service.store.get_batch_any(first.id))
    record.status = BatchStatus.COMPLETED.value
    loop_thread.run(service.store.save_batch(record))
    create("alpha")  # room again


def test_a_line_whose_answer_is_over_the_byte_bound_is_not_rerun_and_is_billed_as_admitted(
        served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """An answer past `max_upstream_answer_bytes` (here: any answer over 16 bytes) was computed
    upstream: the line is a 502 in the error file, run once (not retried as a passing failure),
    and its usage row bills the reservation (prompt estimate, max_tokens), not 0."""
    from gateway.backends import openai_compat
    from gateway.request.canonical import CanonicalRequest, Message, estimate_prompt_tokens

    real = openai_compat._read_json

    async def tiny_bound(response: Any, max_bytes: int) -> Any:
        return await real(response, 16)

    monkeypatch.setattr(openai_compat, "_read_json", tiny_bound)
    client = served.client()
    batch = submit(client, [chat_line("big", "too big to read")])
    done = wait_done(client, batch.id)
    (error,) = read_jsonl(client, done.error_file_id)
    assert error["custom_id"] == "big" and error["response"]["status_code"] == 502
    assert "max_upstream_answer_bytes" in error["response"]["body"]["error"]["message"]
    assert sum(b.get("messages", [{}])[-1].get("content") == "too big to read"
               for b in served.state.bodies) == 1
    prompt = estimate_prompt_tokens(CanonicalRequest("r", MODEL, messages=[
        Message("system", "You are terse."), Message("user", "too big to read")]))
    assert [row[1:3] for row in served.ledger(batch.id + "/")] == [(prompt, 4)]
