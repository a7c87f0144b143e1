"""Metering fixtures: each behaviour runs on the Redis meter and on the embedded SQLite meter."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from auth.principal import Principal, Scope
from gateway.metering import BaseMeter, MeteringSettings, UsageRecord, open_meter
from tests.redis_cluster import clean_url_for

OpenMeter = Callable[[MeteringSettings], Awaitable[BaseMeter]]


@pytest.fixture(params=["redis", "redis-cluster", "sqlite"])
def open_test_meter(request: pytest.FixtureRequest, tmp_path: Path) -> OpenMeter:
    """`await open_test_meter(settings)`: a meter on a fresh store; call close() when done."""
    redis_url = clean_url_for(str(request.param), request)

    async def open_one(settings: MeteringSettings) -> BaseMeter:
        return await open_meter(settings, redis=redis_url, data_dir=tmp_path / "data")

    return open_one


def principal(project: str = "acme", key_id: str = "k1") -> Principal:
    return Principal(project, key_id, frozenset([Scope.INVOKE.value]))


def record(request_id: str, prompt_tokens: int, completion_tokens: int, *, project: str = "acme",
           key_id: str = "k1", model: str = "m", cached_tokens: int = 0, cost_usd: float = 0.0,
           stream: bool = False, created_at: float | None = None) -> UsageRecord:
    return UsageRecord(
        request_id=request_id, project=project, key_id=key_id, model=model, endpoint="r0",
        prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
        completion_tokens=completion_tokens, cost_usd=cost_usd, latency_ms=12.5, status=200,
        created_at=time.time() if created_at is None else created_at, stream=stream,
        finish_reason="stop")
