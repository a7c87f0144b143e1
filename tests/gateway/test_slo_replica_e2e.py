"""Admission control end to end: a real replica (the default model, engine/server over the
engine) with a 1 ms TTFT target refuses the requests that would queue behind a burst; through
the gateway, as `aigw serve` runs it (keys and the SQLite usage ledger), the real openai and
anthropic SDKs get a 429 with Retry-After in their own error shape, and the ledger bills exactly
the answered requests' tokens: a refusal settles once, with none."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.settings import GatewaySettings
from gateway.web.keys import METER
from gateway.web.services import create_served_app
from tests.gateway.conftest import LoopThread, start_app, wait_until

pytestmark = pytest.mark.slow
NUM_BURST = 5


@pytest.fixture(scope="module")
def refusing_replica() -> Iterator[Any]:
    """A replica server on the default model whose TTFT target (1 ms) any queue breaks."""
    import torch

    from bench.engine_bench import load_model  # (the checkpoint, shared with the bench tests)
    from engine.async_engine import AsyncEngine
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.engine import LLMEngine
    from engine.loader import default_model_path
    from engine.model_runner import ModelRunner
    from engine.server import ReplicaServerSettings
    from tests.engine.server.conftest import ServerThread

    torch.set_num_threads(1)
    path = str(default_model_path())
    checkpoint, tokenizer = load_model(path)
    config = EngineConfig(model_path=path, num_threads=1, dtype="float32",
                          cache=CacheConfig(kv_cache_memory_bytes=64 << 20),
                          scheduler=SchedulerConfig(ttft_p90_ms=1.0, tpot_p90_ms=10_000.0,
                                                    policy="slo"))
    runner = ModelRunner(config, checkpoint.config, dict(checkpoint.weights), dict(checkpoint.raw))
    engine = AsyncEngine(LLMEngine(config, checkpoint.config, runner, tokenizer))
    server = ServerThread(engine, ReplicaServerSettings())
    server.start()
    try:
        yield server, engine.model_config.model_id
    finally:
        server.stop()
        engine.shutdown()


async def _keys(data_dir: Path) -> tuple[str, str]:
    """(an invoke key of project `team`, an admin key of project `ops`)."""
    from auth import AuthSettings, open_auth

    services = await open_auth(AuthSettings(data_dir=data_dir))
    try:
        for project in ("team", "ops"):
            await services.admin.create_project(project)
        _, key = await services.admin.create_key("team", ["ai_gateway:invoke"])
        _, admin_key = await services.admin.create_key("ops", ["ai_gateway:admin"])
        return key, admin_key
    finally:
        await services.close()


@pytest.fixture(scope="module")
def gateway(refusing_replica: Any, loop_thread: LoopThread,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str, Any, str]]:
    """(gateway url, key, model, its meter, an admin key)."""
    server, model = refusing_replica
    data_dir = tmp_path_factory.mktemp("slo-gateway")
    key, admin_key = loop_thread.run(_keys(data_dir))
    settings = GatewaySettings(data_dir=data_dir, health_interval_s=0.5, first_token_timeout_s=120,
                               idle_timeout_s=60, response_timeout_s=120,
                               models=[{"name": model, "backend": "replica", "ttft_p90_ms": 1,
                                        "endpoints": [server.base_url]}])
    app = loop_thread.run(create_served_app(settings))
    runner, url = loop_thread.run(start_app(app))
    yield url, key, model, app[METER], admin_key
    loop_thread.run(runner.cleanup())


def _ledger(loop_thread: LoopThread, meter: Any) -> tuple[int, int, int]:
    """(requests, prompt + completion tokens, cost in nano-USD) billed to project `team`."""
    async def read() -> list[Any]:
        await asyncio.sleep(0)
        return list(await meter.usage_by_project("team", ("model",)))

    rows = loop_thread.run(read())
    return (sum(r.requests for r in rows), sum(r.total_tokens for r in rows),
            sum(r.cost_nanos for r in rows))


def _burst(call: Any) -> list[Any]:
    """NUM_BURST calls at once: each its answer, or the exception it raised."""
    def attempt(i: int) -> Any:
        try:
            return call(i)
        except Exception as exc:  # noqa: BLE001 - collected for the assertions
            return exc

    with ThreadPoolExecutor(NUM_BURST) as pool:
        return list(pool.map(attempt, range(NUM_BURST)))


# ~560 tokens: a prefill of ~1-2 s (float32, one thread), so the burst's requests overlap even
# when a loaded machine spreads their arrivals (with ~140 tokens, five Anthropic calls once
# arrived one after another, each to an idle replica, and none was refused)
PROMPT = " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 40)


def test_a_burst_past_the_ttft_target_is_refused_with_retry_after_and_billed_exactly(
        gateway: tuple[str, str, str, Any, str], loop_thread: LoopThread) -> None:
    url, key, model, meter, admin_key = gateway
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
    claude = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120)
    # the replica fits its step-time model on its first steps (a prefill, then decodes)
    client.chat.completions.create(model=model, max_tokens=6,
                                   messages=[{"role": "user", "content": "Say hi"}])
    assert wait_until(lambda: _ledger(loop_thread, meter)[0] == 1, timeout_s=10)
    before = _ledger(loop_thread, meter)

    answers = _burst(lambda i: client.chat.completions.create(
        model=model, max_tokens=4, stream=i % 2 == 1,
        **({"stream_options": {"include_usage": True}} if i % 2 else {}),
        messages=[{"role": "user", "content": f"{i}: {PROMPT}"}]))
    refused = [a for a in answers if isinstance(a, openai.RateLimitError)]
    served = [a for a in answers if not isinstance(a, Exception)]
    assert len(refused) + len(served) == NUM_BURST, answers
    assert refused and served, answers
    for error in refused:
        assert int(error.response.headers["retry-after"]) >= 1
        assert error.code == "latency_target"
        assert error.body["type"] == "rate_limit_error"  # type: ignore[index]
    billed = 0
    for answer in served:
        if isinstance(answer, openai.Stream):
            chunks = list(answer)
            billed += chunks[-1].usage.total_tokens
        else:
            billed += answer.usage.total_tokens

    messages = _burst(lambda i: claude.messages.create(
        model=model, max_tokens=4, messages=[{"role": "user", "content": f"{i}! {PROMPT}"}]))
    rate_limited = [m for m in messages if isinstance(m, anthropic.RateLimitError)]
    answered = [m for m in messages if isinstance(m, anthropic.types.Message)]
    assert len(rate_limited) + len(answered) == NUM_BURST, messages
    assert rate_limited, messages
    for error in rate_limited:
        assert int(error.response.headers["retry-after"]) >= 1
        assert error.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    billed += sum(m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
                  + m.usage.output_tokens for m in answered)  # (Anthropic's input excludes hits)

    # every request settled once; the refused ones billed nothing
    assert wait_until(lambda: _ledger(loop_thread, meter)[0] == before[0] + 2 * NUM_BURST,
                      timeout_s=10), _ledger(loop_thread, meter)
    _, tokens, _ = _ledger(loop_thread, meter)
    assert tokens - before[1] == billed

    # the dashboard's latency-target panel reads the replica's per-class series
    overview = httpx.get(url + "/dashboard/api/overview",
                         headers={"authorization": f"Bearer {admin_key}"}, timeout=30).json()
    row = next(r for r in overview["slo"] if r["service_tier"] == "default")
    assert row["model"] == model and row["ttft_target_ms"] == 1.0
    assert row["refused"] >= len(refused) + len(rate_limited)
    assert row["completed"] >= 1 + len(served) + len(answered)
    assert row["ttft_within"] is False and row["ttft_p90_s"] > 0.001
