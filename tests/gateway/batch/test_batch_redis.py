"""The Batch API on Redis (state, auth and meter) with a shared file directory: a batch started
on one gateway, which stops mid-batch, is finished by another gateway with its own data_dir once
the first one's lease lapses; every line runs and is metered once."""

from __future__ import annotations

import io
import time
from pathlib import Path

import openai
import pytest

from bench.mock_upstream import MockConfig, MockState, create_mock_app
from gateway.settings import GatewaySettings
from gateway.web.keys import METER
from gateway.web.services import create_served_app
from tests.gateway.batch.test_batch_api import chat_line, jsonl, read_jsonl, wait_done
from tests.gateway.conftest import MODEL, LoopThread, start_app


@pytest.mark.parametrize("fixture", ["own_redis_database_url", "clean_redis_cluster_url"])
def test_another_gateway_finishes_a_batch_from_the_shared_store(
        request: pytest.FixtureRequest, fixture: str, loop_thread: LoopThread,
        tmp_path: Path) -> None:
    redis_url = request.getfixturevalue(fixture)
    state = MockState(MockConfig(model=MODEL, num_tokens=2, latency_ms=60.0))
    upstream, upstream_url = loop_thread.run(start_app(create_mock_app(state)))

    def gateway(data_dir: Path) -> tuple[object, str, object]:
        settings = GatewaySettings(
            redis_url=redis_url, data_dir=data_dir, health_interval_s=0.2,
            batch={"poll_interval_s": 0.1, "lease_s": 1.0, "max_concurrent_lines": 1,
                   "files_dir": tmp_path / "shared-files"},
            models=[{"name": MODEL, "backend": "replica", "endpoints": [upstream_url],
                     "prices": {"input_per_token": 1e-6}}])
        app = loop_thread.run(create_served_app(settings))
        runner, url = loop_thread.run(start_app(app))
        return runner, url, app

    first, url, _ = gateway(tmp_path / "a")
    key = (tmp_path / "a" / "default-key.txt").read_text().strip()
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)
        uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(
            [chat_line(f"r-{i}", f"line {i}") for i in range(12)]))), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        deadline = time.monotonic() + 20
        while client.batches.retrieve(batch.id).request_counts.completed < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        loop_thread.run(first.cleanup())  # type: ignore[attr-defined]
    second, url, app = gateway(tmp_path / "b")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)
        midway = client.batches.retrieve(batch.id)
        assert midway.status == "in_progress" and midway.request_counts.completed < 12
        done = wait_done(client, batch.id, 60)
        assert done.status == "completed" and done.request_counts.completed == 12
        assert sorted(o["custom_id"] for o in read_jsonl(client, done.output_file_id)) == sorted(
            f"r-{i}" for i in range(12))
        records = loop_thread.run(app[METER].usage_records("default"))  # type: ignore[index]
        ids = sorted(r.request_id for r in records if r.request_id.startswith(batch.id))
        assert ids == sorted(f"{batch.id}/{i}" for i in range(12))
    finally:
        loop_thread.run(second.cleanup())  # type: ignore[attr-defined]
        loop_thread.run(upstream.cleanup())


def test_two_gateways_on_one_store_run_each_line_once(
        own_redis_database_url: str, loop_thread: LoopThread, tmp_path: Path) -> None:
    """The lease is renewed while a gateway works a batch (here for far longer than lease_s), so
    the other gateway never runs its lines too."""
    state = MockState(MockConfig(model=MODEL, num_tokens=2, latency_ms=100.0))
    upstream, upstream_url = loop_thread.run(start_app(create_mock_app(state)))
    gateways = []
    for name in ("a", "b"):
        settings = GatewaySettings(
            redis_url=own_redis_database_url, data_dir=tmp_path / name, health_interval_s=0.2,
            batch={"poll_interval_s": 0.05, "lease_s": 1.0, "max_concurrent_lines": 1,
                   "files_dir": tmp_path / "shared-files"},
            models=[{"name": MODEL, "backend": "replica", "endpoints": [upstream_url]}])
        gateways.append(loop_thread.run(start_app(loop_thread.run(create_served_app(settings)))))
    try:
        key = (tmp_path / "a" / "default-key.txt").read_text().strip()
        client = openai.OpenAI(base_url=gateways[0][1] + "/v1", api_key=key, max_retries=0,
                               timeout=30)
        uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(
            [chat_line(f"t-{i}", f"twice? {i}") for i in range(30)]))), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        done = wait_done(client, batch.id, 60)
        assert done.status == "completed" and done.request_counts.completed == 30
        sent = [m["content"] for b in state.bodies for m in b["messages"] if m["role"] == "user"]
        assert sorted(sent) == sorted(f"twice? {i}" for i in range(30))  # each line once
    finally:
        for runner, _ in gateways:
            loop_thread.run(runner.cleanup())
        loop_thread.run(upstream.cleanup())
