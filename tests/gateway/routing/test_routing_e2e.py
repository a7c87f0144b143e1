"""End to end: two real replicas (default model, 64 MiB of KV each) behind the gateway with the
prefix router, once with the in-process index and once with the Redis index."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from gateway.fleet import embedded
from gateway.routing.prefix_router import PrefixRouter, PrefixRouterConfig
from gateway.settings import GatewaySettings
from gateway.web.app import create_app
from gateway.web.keys import FLEET
from infra import ports
from tests.gateway.conftest import LoopThread, start_app

pytestmark = pytest.mark.slow


def replica_command(port: int, redis_url: str) -> list[str]:
    return [sys.executable, "-m", "cli.main", "replica", "--port", str(port), "--threads", "1",
            "--kv-cache-memory", "67108864", "--redis-url", redis_url, "--no-auth"]


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def replicas(redis_url: str) -> Iterator[list[embedded.ReplicaProcess]]:
    started = []
    for _ in range(2):
        port = ports.free_port()
        started.append(embedded.ReplicaProcess(subprocess.Popen(replica_command(port, redis_url)),
                                               f"http://127.0.0.1:{port}"))
    try:
        embedded.wait_healthy(started, timeout_s=120)
        yield started
    finally:
        embedded.stop_replicas(started)


class Served:
    def __init__(self, url: str, model: str, router: PrefixRouter, loop: LoopThread) -> None:
        self.url, self.model, self.router, self.loop = url, model, router, loop
        self.client = httpx.Client(base_url=url, timeout=120)

    def chat(self, messages: list[dict[str, Any]], request_id: str = "") -> tuple[str, int, str]:
        headers = {"x-request-id": request_id} if request_id else {}
        response = self.client.post("/v1/chat/completions", headers=headers, json={
            "model": self.model, "messages": messages, "max_tokens": 4, "temperature": 0})
        assert response.status_code == 200, response.text
        body = response.json()
        cached = body["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
        return response.headers["x-aigw-replica"], cached, body["choices"][0]["message"]["content"]

    def num_blocks(self, replica_name: str) -> int:
        assert self.router.index is not None
        return self.loop.run(self.router.index.num_blocks(replica_name))


@contextlib.contextmanager
def open_served(kind: str, replicas: list[embedded.ReplicaProcess], loop_thread: LoopThread,
                redis_url: str) -> Iterator[Served]:
    embedded.wait_healthy(replicas, timeout_s=120)
    model = embedded.model_settings_for(replicas)
    settings = GatewaySettings(auth_enabled=False, models=[model], health_interval_s=0.5,
                               first_token_timeout_s=60, idle_timeout_s=30)
    config = PrefixRouterConfig(redis_url=redis_url if kind == "redis" else None,
                                redis_prefix=f"e2e{time.monotonic_ns()}")
    router = PrefixRouter(config)
    app = create_app(settings, router=router)
    runner, url = loop_thread.run(start_app(app))
    served = Served(url, model.name, router, loop_thread)
    try:
        deadline = time.monotonic() + 30
        endpoints = app[FLEET].routes[model.name].endpoints
        while not all(getattr(router.consumer(e), "is_synced", False) for e in endpoints):
            assert time.monotonic() < deadline, "consumers never synced"
            time.sleep(0.05)
        yield served
    finally:
        served.client.close()
        loop_thread.run(runner.cleanup())


@pytest.fixture(scope="module", params=["in_process", "redis"])
def served(request: pytest.FixtureRequest, replicas: list[embedded.ReplicaProcess],
           loop_thread: LoopThread, redis_url: str) -> Iterator[Served]:
    with open_served(request.param, replicas, loop_thread, redis_url) as served:
        yield served


def conversation(topic: str, num_turns: int) -> list[list[dict[str, Any]]]:
    system = {"role": "system", "content": f"You are an assistant for {topic}. " * 12}
    turns, messages = [], [system]
    for turn in range(num_turns):
        messages = [*messages, {"role": "user", "content": f"Question {turn} about {topic}?"}]
        turns.append(messages)
        messages = [*messages, {"role": "assistant", "content": f"Answer {turn}."}]
    return turns


def test_turns_of_a_conversation_stay_on_the_replica_holding_its_prefix(served: Served) -> None:
    replicas_seen, cached, accounts = [], [], []
    for turn, messages in enumerate(conversation("gardening", 4)):
        replica, num_cached, _ = served.chat(messages, request_id=f"garden-{turn}")
        replicas_seen.append(replica)
        cached.append(num_cached)
        accounts.append(served.router.explain(f"garden-{turn}") or "")
    assert len(set(replicas_seen)) == 1
    assert all(c > 0 for c in cached[1:]), cached
    assert all(a.startswith(f"prefix -> {replicas_seen[0]}") for a in accounts[1:]), accounts
    assert served.num_blocks(replicas_seen[0]) > 0


def test_different_prefixes_spread_over_both_replicas(served: Served) -> None:
    topics = [f"topic {i} {'x' * i}" for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        seen = list(pool.map(lambda t: served.chat(conversation(t, 1)[0])[0], topics))
    assert len(set(seen)) == 2, seen


def test_a_killed_replicas_entries_leave_both_indexes_and_its_traffic_moves(
        replicas: list[embedded.ReplicaProcess], loop_thread: LoopThread, redis_url: str) -> None:
    with (open_served("in_process", replicas, loop_thread, redis_url) as in_process,
          open_served("redis", replicas, loop_thread, redis_url) as shared):
        turns = conversation("astronomy", 3)
        victim, _, _ = shared.chat(turns[0])
        assert in_process.chat(turns[0])[0] == victim  # same prefix, same rendezvous choice
        assert shared.num_blocks(victim) > 0 and in_process.num_blocks(victim) > 0
        index = next(i for i, r in enumerate(replicas) if r.url.endswith(victim))
        replicas[index].process.kill()
        replicas[index].process.wait()
        try:
            deadline = time.monotonic() + 10
            while shared.num_blocks(victim) or in_process.num_blocks(victim):
                assert time.monotonic() < deadline, "the killed replica's entries stayed"
                time.sleep(0.1)
            assert shared.chat(turns[1])[0] != victim
            assert in_process.chat(turns[1])[0] != victim
        finally:  # back on the same port for any test that runs after this one
            port = int(victim.rsplit(":", 1)[1])
            replicas[index] = embedded.ReplicaProcess(  # open_served waits for its health
                subprocess.Popen(replica_command(port, redis_url)), replicas[index].url)
