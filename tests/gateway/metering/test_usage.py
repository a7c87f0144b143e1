"""Usage records: once per request id, priced, and read back with totals that match."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import replace

from gateway.metering import (
    Limits,
    MeteringSettings,
    ModelPrice,
    UsageRow,
    cost_usd,
    render_csv,
    render_json,
)
from tests.gateway.metering.conftest import OpenMeter, principal, record

PRICES = MeteringSettings(prices={
    "big": ModelPrice(input=3.0, cached_input=0.3, output=15.0),
    "small": ModelPrice(input=0.15, output=0.6)})


def test_cached_prompt_tokens_are_billed_at_the_cached_price() -> None:
    # 1M prompt tokens of which 400k cached, 100k completion, USD per million tokens
    assert cost_usd(PRICES, "big", 1_000_000, 400_000, 100_000) == 600_000 * 3.0 / 1e6 + \
        400_000 * 0.3 / 1e6 + 100_000 * 15.0 / 1e6
    assert cost_usd(PRICES, "small", 1_000_000, 1_000_000, 0) == 0.15  # cached defaults to input
    assert cost_usd(PRICES, "unpriced", 10, 0, 10) == 0.0


def test_settling_the_same_request_twice_counts_it_once(open_test_meter: OpenMeter) -> None:
    async def scenario() -> None:
        meter = await open_test_meter(MeteringSettings(
            default_project_limits={"tokens_per_minute": 1000}))
        try:
            admission = await meter.admit("req-1", principal(), "m", 10, 90)
            assert admission.headers["x-ratelimit-remaining-tokens"] == "900"
            done = record("req-1", 10, 5, cost_usd=0.25)
            await meter.settle(admission, done)
            await meter.settle(admission, done)
            await meter.settle(admission, replace(done, completion_tokens=50))  # a retry
            rows = await meter.usage_by_project("acme", group_by=())
            assert [(r.requests, r.prompt_tokens, r.completion_tokens, r.cost_usd)
                    for r in rows] == [(1, 10, 5, 0.25)]
            assert await meter.usage_records("acme") == [done]
            # the reservation (100) was replaced by the actual 15 exactly once
            after = await meter.admit("req-2", principal(), "m", 0, 1)
            assert after.headers["x-ratelimit-remaining-tokens"] == str(1000 - 15 - 1)
        finally:
            await meter.close()

    asyncio.run(scenario())


def test_queued_settles_are_seen_by_reads_and_count_once(open_test_meter: OpenMeter) -> None:
    """settle_nowait (the gateway's path) returns before the write; reads and the next budget
    check see it, and settling the same request twice still counts it once."""
    async def scenario() -> None:
        meter = await open_test_meter(MeteringSettings(
            default_project_limits={"tokens_per_minute": 1000}))
        try:
            admission = await meter.admit("req-1", principal(), "m", 10, 90)
            done = record("req-1", 10, 5, cost_usd=0.25)
            meter.settle_nowait(admission, done)
            meter.settle_nowait(admission, done)
            assert await meter.usage_records("acme") == [done]  # no sleep: the read waits
            rows = await meter.usage_by_project("acme", group_by=())
            assert [(r.requests, r.completion_tokens) for r in rows] == [(1, 5)]
            after = await meter.admit("req-2", principal(), "m", 0, 1)
            assert after.headers["x-ratelimit-remaining-tokens"] == str(1000 - 15 - 1)
        finally:
            await meter.close()

    asyncio.run(scenario())


def test_usage_totals_equal_the_sum_of_settled_records_over_a_mix(
        open_test_meter: OpenMeter) -> None:
    """Streamed and plain requests, disconnects (partial completions billed), retries of the
    same request id, two models and two projects, settled concurrently."""
    rng = random.Random(7)

    async def scenario() -> None:
        meter = await open_test_meter(PRICES.model_copy(update={
            "default_project_limits": Limits(tokens_per_minute=10_000_000)}))
        shown: dict[str, object] = {}  # request id -> the record whose usage the client saw

        async def one(i: int) -> None:
            project = "acme" if i % 5 else "other"
            model = rng.choice(["big", "small"])
            prompt, cached = rng.randint(1, 500), 0
            cached = rng.randint(0, prompt)
            max_tokens = rng.randint(1, 300)
            completion = rng.randint(0, max_tokens) if i % 7 else max_tokens // 3  # disconnect
            admission = await meter.admit(f"r{i}", principal(project), model, prompt, max_tokens)
            done = record(f"r{i}", prompt, completion, project=project, model=model,
                          cached_tokens=cached, stream=bool(i % 2),
                          cost_usd=meter.cost_usd(model, prompt, cached, completion))
            shown[done.request_id] = done
            await meter.settle(admission, done)
            if i % 4 == 0:  # the gateway's retry of the settle after a timeout
                await meter.settle(admission, done)

        await asyncio.gather(*(one(i) for i in range(60)))
        try:
            for project in ("acme", "other"):
                expected = [r for r in shown.values() if r.project == project]  # type: ignore[attr-defined]
                records = await meter.usage_records(project)
                assert sorted(r.request_id for r in records) == sorted(
                    r.request_id for r in expected)  # type: ignore[attr-defined]
                by_model = await meter.usage_by_project(project, group_by=["model"])
                for model in ("big", "small"):
                    mine = [r for r in expected if r.model == model]  # type: ignore[attr-defined]
                    row = next((r for r in by_model if r.model == model),
                               UsageRow(None, model, 0, 0, 0, 0, 0))
                    assert row.requests == len(mine)
                    assert row.prompt_tokens == sum(r.prompt_tokens for r in mine)
                    assert row.cached_tokens == sum(r.cached_tokens for r in mine)
                    assert row.completion_tokens == sum(r.completion_tokens for r in mine)
                    assert abs(row.cost_usd - sum(r.cost_usd for r in mine)) < 1e-9
                by_day = await meter.usage_by_project(project, group_by=["day", "model"])
                assert sum(r.requests for r in by_day) == len(expected)
                assert all(r.day is not None and r.model is not None for r in by_day)
                assert await meter.usage_by_project(project, since="2999-01-01") == []
        finally:
            await meter.close()

    asyncio.run(scenario())


def test_usage_renders_as_json_and_csv() -> None:
    rows = [UsageRow("2026-01-02", "m", 2, 10, 4, 6, 1_500_000_000)]
    data = json.loads(render_json("acme", rows))
    assert data == {"project": "acme", "data": [{
        "day": "2026-01-02", "model": "m", "requests": 2, "prompt_tokens": 10,
        "cached_tokens": 4, "completion_tokens": 6, "total_tokens": 16, "cost_usd": 1.5}]}
    assert render_csv(rows) == ("day,model,requests,prompt_tokens,cached_tokens,"
                                "completion_tokens,total_tokens,cost_usd\n"
                                "2026-01-02,m,2,10,4,6,16,1.5\n")


def test_a_disabled_meter_admits_everything_and_records_nothing(open_test_meter: OpenMeter) -> None:
    async def scenario() -> None:
        meter = await open_test_meter(MeteringSettings(
            enabled=False, default_project_limits=Limits(requests_per_minute=1)))
        try:
            for request_id in ("a", "b", "c"):
                await meter.settle(await meter.admit(request_id, principal(), "m", 1, 1),
                                   record(request_id, 1, 1))
            assert await meter.usage_by_project("acme") == []
        finally:
            await meter.close()

    asyncio.run(scenario())


def test_a_queued_rows_weight_counts_every_string_and_8_bytes_a_number() -> None:
    """The embedded meter's backlog bound weighs a row in O(1) calls; it must still count each
    string's length (a long model or project name weighs more) and 8 for anything else."""
    from gateway.metering.embedded_meter import _row, _row_bytes

    for rec in (record("r-1", 10, 5), replace(record("r-2", 1, 1), finish_reason=None),
                record("r-" + "x" * 500, 3, 4, project="p" * 300, key_id="k" * 70,
                       model="m" * 1000)):
        row = _row(rec, 12_345)
        assert _row_bytes(row) == 200 + sum(len(v) if isinstance(v, str) else 8 for v in row)
