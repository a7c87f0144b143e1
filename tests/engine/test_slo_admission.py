"""Admission control on the real model (SmolLM2-135M) behind the real replica HTTP app: with a TTFT
target, a request whose predicted queueing breaks it is refused at once (429 latency_target with
Retry-After and x-aigw-predicted-queue-ms, through the openai SDK), leaves no request or KV block
behind, and is counted per class; a priority request behind the same queue is admitted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from contracts.replica_errors import PREDICTED_QUEUE_HEADER
from contracts.sampling_params import SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.server import ReplicaServerSettings
from tests.engine.fakes import assert_idle_and_clean
from tests.engine.server.conftest import ServerThread

TTFT_TARGET_MS = 200.0
FLOOD = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def replica(model_path: str, checkpoint: Any,
            tokenizer: Any) -> Iterator[tuple[ServerThread, LLMEngine]]:
    from engine.model_runner import ModelRunner

    config = EngineConfig(
        model_path=model_path, num_threads=1, dtype="float32",
        cache=CacheConfig(kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8,
                                  ttft_p90_ms=TTFT_TARGET_MS, policy="fixed"))
    runner = ModelRunner(config, checkpoint.config, dict(checkpoint.weights), dict(checkpoint.raw))
    engine = LLMEngine(config, checkpoint.config, runner, tokenizer)
    async_engine = AsyncEngine(engine)
    server = ServerThread(async_engine, ReplicaServerSettings())
    server.start()
    yield server, engine
    server.stop()
    async_engine.shutdown()


def _flood(server: ServerThread, async_engine: Any, prompts: list[list[int]]) -> list[Any]:
    """Engine requests started behind the HTTP edge (admission is the edge's), consumed to the
    end."""
    async def consume(request_id: str, prompt: list[int]) -> None:
        async for _ in async_engine.generate(request_id, prompt, FLOOD, priority=0):
            pass

    return [asyncio.run_coroutine_threadsafe(consume(f"flood-{i}", p), server._loop)
            for i, p in enumerate(prompts)]


def test_a_request_the_queue_would_make_late_is_refused_at_once_and_leaves_nothing(
        replica: tuple[ServerThread, LLMEngine], tokenizer: Any) -> None:
    server, engine = replica
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                           timeout=300)
    model = engine.model_config.model_id
    short = [{"role": "user", "content": "Say hi."}]
    client.chat.completions.create(model=model, messages=short, max_tokens=8)  # measures the steps
    assert engine.scheduler.step_costs.cost is not None

    long_prompt = tokenizer.encode("count the sheep " * 100)[:200]
    futures = _flood(server, server._engine, [long_prompt] * 4)  # 800 prompt tokens at 64 a step
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model=model, messages=short, max_tokens=4,
                                       extra_headers={"x-request-id": "refused-1"})
    response = refused.value.response
    assert response.status_code == 429
    predicted_ms = int(response.headers[PREDICTED_QUEUE_HEADER])
    assert predicted_ms > TTFT_TARGET_MS
    assert int(response.headers["Retry-After"]) == max(1, -(-predicted_ms // 1000))
    error = response.json()["error"]
    assert ((error["type"], error["code"], error["param"])
            == ("server_overloaded", "latency_target", None))
    assert "target" in error["message"]

    # the same queue is not ahead of the priority class: admitted, answered
    urgent = client.chat.completions.create(model=model, messages=short, max_tokens=4,
                                            extra_body={"service_tier": "priority"})
    assert urgent.choices[0].message.content is not None

    for future in futures:
        future.result(timeout=300)
    deadline = time.monotonic() + 30
    while engine.has_unfinished_requests and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(r.startswith("chatcmpl") for r in engine._requests)
    assert_idle_and_clean(engine)  # the refused request never reached the engine

    metrics = httpx.get(server.base_url + "/metrics", timeout=30).text
    assert (_sample(metrics, "aigw_replica_admissions_refused_total", 'service_tier="default"')
            == 1.0)
    assert _sample(metrics, "aigw_replica_admissions_refused_total",
                   'service_tier="priority"') is None
    assert (_sample(metrics, "aigw_replica_completed_requests_total", 'service_tier="priority"')
            == 1.0)
    assert _sample(metrics, "aigw_replica_predicted_queue_delay_ms", 'service_tier="flex"') == 0.0
    assert (_sample(metrics, "aigw_replica_ttft_target_ms", 'service_tier="flex"')
            == 4 * TTFT_TARGET_MS)
    assert (_sample(metrics, "aigw_replica_prefill_ms_per_token", "") or 0.0) > 0.0


def test_an_admitted_request_counts_as_queued_before_its_engine_request_starts(
        replica: tuple[ServerThread, LLMEngine]) -> None:
    """A burst's handlers may all pass admission before any of them starts its engine request
    (each awaits between the two): the admitted prompt is held as pending in the same step as
    the check, so the next check sees it; a hold whose request never starts is released."""
    server, engine = replica
    async_engine: AsyncEngine = server._engine
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                           timeout=300)
    client.chat.completions.create(model=engine.model_config.model_id, max_tokens=4,
                                   messages=[{"role": "user", "content": "Say hi."}])
    assert engine.scheduler.step_costs.cost is not None and not engine.has_unfinished_requests
    first = async_engine.admit(0, {"held-a": 800})
    assert first.is_admitted and first.queue_ms == 0.0
    second = async_engine.admit(0, {"held-b": 8})
    assert not second.is_admitted and second.queue_ms > TTFT_TARGET_MS
    assert async_engine.admit(-1, {"held-c": 8}).is_admitted  # the class ahead does not wait
    async_engine.release_holds(["held-a", "held-b", "held-c"])  # (b was never held)
    again = async_engine.admit(0, {"held-d": 8})
    assert again.is_admitted and again.queue_ms == 0.0
    async_engine.release_holds(["held-d"])
    assert async_engine._pending_tokens == {} and async_engine._held == {}


def _sample(text: str, name: str, label: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    return None
