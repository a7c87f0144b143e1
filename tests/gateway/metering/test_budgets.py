"""Budgets over day/month/custom windows, concurrency limits, stored (run-time) limits and the
alert claim, on the Redis meter, Redis Cluster and the embedded meter; two meters on one Redis
hold a budget and a concurrency limit together."""

from __future__ import annotations

import asyncio
import calendar
from pathlib import Path

import pytest

from gateway.metering import Limits, MeteringSettings, ModelPrice, RateLimited, open_meter
from gateway.metering.budgets import Budget
from gateway.metering.limit_store import LimitScope, StoredLimits, open_limit_store
from gateway.metering.limits import MeterAdmission, Spend
from tests.gateway.metering.conftest import OpenMeter, principal, record

PRICES = {"m": ModelPrice(input=1_000.0, output=1_000.0)}  # 0.001 USD a token


def test_windows_of_each_kind_start_and_end_where_they_should() -> None:
    now = calendar.timegm((2026, 12, 31, 23, 30, 0))
    month = Budget(usd=1, window="month").window_at(now)
    assert month.key == "2026-12" and month.end_s == calendar.timegm((2027, 1, 1, 0, 0, 0))
    assert month.start_s == calendar.timegm((2026, 12, 1, 0, 0, 0))
    day = Budget(usd=1).window_at(now)
    assert day.key == "2026-12-31" and day.reset_s(now) == 1800
    hourly = Budget(usd=1, window="custom", window_s=3600, starts_at=600).window_at(now)
    assert (hourly.start_s == now - 1800 + 600 - 3600 + 3600
            and hourly.end_s - hourly.start_s == 3600)
    assert hourly.start_s <= now < hourly.end_s
    with pytest.raises(ValueError):
        Budget(usd=1, window="custom")
    with pytest.raises(ValueError):
        Limits(budgets=(Budget(usd=1), Budget(usd=2)))


def test_a_month_and_a_custom_budget_each_refuse_within_one_request(
        open_test_meter: OpenMeter) -> None:
    async def scenario() -> None:
        meter = await open_test_meter(MeteringSettings(prices=PRICES, default_project_limits=Limits(
            budgets=(Budget(usd=0.05, window="month"),
                     Budget(usd=0.03, window="custom", window_s=3600)))))
        try:
            admission = await meter.admit("a", principal(), "m", 10, 10)  # reserves 0.02
            await meter.settle(admission, record("a", 10, 10, cost_usd=0.02))
            admission = await meter.admit("b", principal(), "m", 5, 5)  # 0.02 + 0.01
            await meter.settle(admission, record("b", 5, 5, cost_usd=0.01))
            with pytest.raises(RateLimited) as refused:  # the custom window is spent (0.03)
                await meter.admit("c", principal(), "m", 1, 1)
            assert "budget of 3600 s of this project is spent" in refused.value.message
            assert refused.value.retry_after_s <= 3600
        finally:
            await meter.close()

    asyncio.run(scenario())


def test_the_concurrency_limit_frees_a_slot_at_settle(open_test_meter: OpenMeter) -> None:
    async def scenario() -> None:
        meter = await open_test_meter(MeteringSettings(
            default_key_limits=Limits(max_concurrent_requests=2)))
        try:
            first = await meter.admit("a", principal(), "m", 1, 1)
            await meter.admit("b", principal(), "m", 1, 1)
            with pytest.raises(RateLimited) as refused:
                await meter.admit("c", principal(), "m", 1, 1)
            assert "concurrent requests" in refused.value.message
            await meter.admit("d", principal(key_id="k2"), "m", 1, 1)  # another key: its own
            meter.settle_nowait(first, record("a", 1, 1))
            await meter.admit("e", principal(), "m", 1, 1)
        finally:
            await meter.close()

    asyncio.run(scenario())


def test_stored_limits_replace_the_settings_for_their_scope_only(
        open_test_meter: OpenMeter) -> None:
    async def scenario() -> None:
        meter = await open_test_meter(MeteringSettings(
            default_project_limits=Limits(requests_per_minute=100)))
        try:
            meter.set_stored_limits(StoredLimits(projects={"acme": Limits(requests_per_minute=1)}))
            await meter.admit("a", principal(), "m", 1, 1)
            with pytest.raises(RateLimited):
                await meter.admit("b", principal(), "m", 1, 1)
            await meter.admit("c", principal(project="other"), "m", 1, 1)
            meter.set_stored_limits(StoredLimits())
            await meter.admit("d", principal(), "m", 1, 1)  # back to the settings' 100
        finally:
            await meter.close()

    asyncio.run(scenario())


def test_a_settle_reports_the_spend_and_an_alert_is_claimed_once(
        open_test_meter: OpenMeter) -> None:
    async def scenario() -> None:
        meter = await open_test_meter(MeteringSettings(prices=PRICES, default_project_limits=Limits(
            budgets=(Budget(usd=1.0, window="day", alert_at=(0.01,)),))))
        seen: list[Spend] = []
        meter._observe_spends = seen.extend  # type: ignore[method-assign]
        try:
            admission = await meter.admit("a", principal(), "m", 10, 10)
            await meter.settle(admission, record("a", 10, 10, cost_usd=0.02))
            assert [s.spent_nanos for s in seen] == [20_000_000]
            assert await meter._claim_alert(seen[0], 0.01)
            assert not await meter._claim_alert(seen[0], 0.01)
            assert await meter._claim_alert(seen[0], 0.5)
        finally:
            await meter.close()

    asyncio.run(scenario())


def test_two_meters_on_one_redis_hold_a_budget_and_a_concurrency_limit(
        any_clean_redis_url: str) -> None:
    settings = MeteringSettings(prices=PRICES, default_project_limits=Limits(
        max_concurrent_requests=3, budgets=(Budget(usd=0.2, window="month"),)))

    async def scenario() -> None:
        meters = [await open_meter(settings, redis=any_clean_redis_url) for _ in range(2)]
        try:
            async def one(i: int) -> MeterAdmission | None:
                try:
                    return await meters[i % 2].admit(f"r{i}", principal(), "m", 5, 5)
                except RateLimited:
                    return None
            held = [a for a in await asyncio.gather(*(one(i) for i in range(10))) if a]
            assert len(held) == 3  # in flight at once, both meters together
            spent = 0.0
            for i in range(40):  # one at a time: the budget decides
                admission = held.pop() if held else await one(100 + i)
                if admission is None:
                    break
                meter = meters[i % 2]
                await meter.settle(admission, record(admission.request_id, 5, 5, cost_usd=0.01))
                spent += 0.01
            assert 0.2 - 0.01 <= spent <= 0.2 + 0.01 + 1e-9
        finally:
            for meter in meters:
                await meter.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("store_kind", ["redis", "sqlite"])
def test_the_limit_store_round_trips_and_bumps_its_version(
        store_kind: str, tmp_path: Path, any_clean_redis_url: str) -> None:
    async def scenario() -> None:
        client = None
        if store_kind == "redis":
            from infra.redis_client import connect_redis

            client = connect_redis(any_clean_redis_url, decode_responses=True)
        store = await open_limit_store(client, tmp_path)
        try:
            version = await store.version()
            limits = Limits(tokens_per_minute=5, budgets=(Budget(usd=2, window="month"),),
                            webhook_url="http://127.0.0.1:1/h", webhook_secret="s" * 16)
            await store.put(LimitScope("acme"), limits)
            await store.put(LimitScope("acme", key_id="k1"), Limits(requests_per_minute=1))
            loaded = await store.load()
            assert loaded.projects["acme"] == limits
            assert loaded.of_project("acme") == {"k1": Limits(requests_per_minute=1)}
            assert await store.version() == version + 2
            assert await store.delete(LimitScope("acme")) is True
            assert await store.delete(LimitScope("acme")) is False
            assert "acme" not in (await store.load()).projects
        finally:
            await store.close()
            if client is not None:
                await client.aclose()

    asyncio.run(scenario())


@pytest.mark.parametrize("budget", [Budget(usd=0.05, window="month"),
                                    Budget(usd=0.05, window="custom", window_s=3600)])
def test_a_budget_set_after_spending_counts_what_its_window_already_spent(
        open_test_meter: OpenMeter, budget: Budget) -> None:
    """The spend counter of a window that had no budget yet starts from the ledger (the
    per-day sums for a project's whole days, else the records), not from zero."""
    async def scenario() -> None:
        meter = await open_test_meter(MeteringSettings(prices=PRICES))
        try:
            for name in ("a", "b"):
                admission = await meter.admit(name, principal(), "m", 10, 10)
                await meter.settle(admission, record(name, 10, 10, cost_usd=0.02))
            meter.set_stored_limits(StoredLimits(projects={"acme": Limits(budgets=(budget,))}))
            with pytest.raises(RateLimited):  # 0.04 spent + 0.02 reserved > 0.05
                await meter.admit("c", principal(), "m", 10, 10)
            await meter.admit("d", principal(), "m", 5, 4)  # 0.04 + 0.009 fits
            meter.set_stored_limits(StoredLimits(keys={"k2": Limits(budgets=(budget,))}))
            await meter.admit("e", principal(key_id="k2"), "m", 10, 10)  # k2 spent nothing
        finally:
            await meter.close()

    asyncio.run(scenario())
