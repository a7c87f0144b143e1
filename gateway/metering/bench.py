"""Micro-benchmark: what authenticate + admit + settle cost per request (no HTTP, no model).

    cost = await measure_hot_path(AuthSettings(redis_url=...), num_requests=2000, concurrency=16)
    python -m gateway.metering.bench [--redis-url URL] [--requests N] [--concurrency C]

It creates a throw-away project and key (under a temp data dir unless given one), puts rpm/tpm and
budget limits on them so every limit path runs, and drives `concurrency` workers on one event
loop. Reported: the p50/p99 latency of the three calls together per request, and the event-loop
time per request (wall time / requests), which is what they add to a saturated gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from auth import Scope, open_auth
from auth.settings import AuthSettings
from gateway.metering import Limits, MeteringSettings, ModelPrice, UsageRecord, open_meter

BENCH_LIMITS = Limits(requests_per_minute=10_000_000, tokens_per_minute=10_000_000_000,
                      daily_budget_usd=1_000_000.0)


@dataclass(frozen=True)
class HotPathCost:
    store: str  # "redis" or "sqlite"
    num_requests: int
    concurrency: int
    p50_us: float  # latency of authenticate + admit + settle, one request, under concurrency
    p99_us: float
    loop_us_per_request: float  # wall time / requests: event-loop time each request takes
    cpu_us_per_request: float  # this process's CPU time / requests (not the store server's)
    redis_ping_us: float | None  # p50 of a bare PING on the same client: the machine's floor


async def measure_hot_path(auth_settings: AuthSettings, metering: MeteringSettings | None = None,
                           num_requests: int = 2000, concurrency: int = 16) -> HotPathCost:
    metering = metering or MeteringSettings(
        prices={"bench-model": ModelPrice(input=1.0, cached_input=0.1, output=2.0)},
        default_project_limits=BENCH_LIMITS, default_key_limits=BENCH_LIMITS)
    services = await open_auth(auth_settings)
    meter = await open_meter(metering, redis=services.redis, data_dir=auth_settings.data_dir)
    project = f"bench-{uuid.uuid4().hex[:8]}"
    try:
        await services.admin.create_project(project)
        _, key = await services.admin.create_key(project, [Scope.INVOKE.value])
        latencies_s: list[float] = []
        next_index = iter(range(num_requests))

        async def one() -> None:
            request_id = uuid.uuid4().hex
            started = time.perf_counter()
            principal = await services.authenticator.authenticate(key)
            principal.require(Scope.INVOKE)
            admission = await meter.admit(request_id, principal, "bench-model", 100, 50)
            cost = meter.cost_usd("bench-model", 100, 20, 40)
            await meter.settle(admission, UsageRecord(
                request_id=request_id, project=principal.project, key_id=principal.key_id,
                model="bench-model", endpoint="bench", prompt_tokens=100, cached_tokens=20,
                completion_tokens=40, cost_usd=cost, latency_ms=1.0, status=200,
                created_at=time.time()))
            latencies_s.append(time.perf_counter() - started)

        async def worker() -> None:
            for _ in next_index:
                await one()

        await one()  # warm the key cache and the scripts
        latencies_s.clear()
        ping_us = None
        if services.redis is not None:
            pings = []
            for _ in range(200):
                ping_started = time.perf_counter()
                await services.redis.ping()
                pings.append(time.perf_counter() - ping_started)
            ping_us = statistics.median(pings) * 1e6
        wall_started, cpu_started = time.perf_counter(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall_s = time.perf_counter() - wall_started
        cpu_s = time.process_time() - cpu_started
    finally:
        await meter.close()
        await services.close()
    quantiles = statistics.quantiles(latencies_s, n=100)
    return HotPathCost(
        store="redis" if auth_settings.redis_url else "sqlite", num_requests=num_requests,
        concurrency=concurrency, p50_us=statistics.median(latencies_s) * 1e6,
        p99_us=quantiles[98] * 1e6, loop_us_per_request=wall_s / num_requests * 1e6,
        cpu_us_per_request=cpu_s / num_requests * 1e6, redis_ping_us=ping_us)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url")
    parser.add_argument("--data-dir", type=Path)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="aigw-bench-") as scratch:
        settings = AuthSettings(redis_url=args.redis_url, data_dir=args.data_dir or Path(scratch))
        cost = asyncio.run(measure_hot_path(settings, num_requests=args.requests,
                                            concurrency=args.concurrency))
    print(json.dumps(asdict(cost)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
