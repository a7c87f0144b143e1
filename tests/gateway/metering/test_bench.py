"""The hot-path micro-benchmark runs on both stores and reports positive numbers (not timed)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from auth.settings import AuthSettings
from gateway.metering.bench import measure_hot_path


@pytest.mark.parametrize("store_kind", ["redis", "sqlite"])
def test_hot_path_benchmark_reports_latency_and_loop_time(
        store_kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    redis_url = request.getfixturevalue("clean_redis_url") if store_kind == "redis" else None
    cost = asyncio.run(measure_hot_path(AuthSettings(redis_url=redis_url, data_dir=tmp_path),
                                        num_requests=64, concurrency=4))
    assert (cost.store, cost.num_requests, cost.concurrency) == (store_kind, 64, 4)
    assert 0 < cost.p50_us <= cost.p99_us
    assert cost.loop_us_per_request > 0
