"""Metering: usage records, prices, rate limits and budgets (Redis or embedded SQLite).

    meter = await open_meter(settings, redis=services.redis, data_dir=auth_settings.data_dir)
    admission = await meter.admit(request_id, principal, model, num_prompt_tokens, max_tokens)
    cost = meter.cost_usd(model, prompt_tokens, cached_tokens, completion_tokens)
    await meter.settle(admission, UsageRecord(..., cost_usd=cost, ...))
    rows = await meter.usage_by_project("acme", group_by=("model", "day"))
    render_json("acme", rows) / render_csv(rows)
    await meter.close()

The gateway sees only the seam in gateway/metering/contract.py (Meter, Admission, UsageRecord,
RateLimited); the returned object also has the read side and prices (BaseMeter).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gateway.metering.contract import Admission, Meter, RateLimited, UsageRecord
from gateway.metering.meter import BaseMeter
from gateway.metering.prices import cost_nanos, cost_usd, price_for
from gateway.metering.settings import Limits, MeteringSettings, ModelPrice
from gateway.metering.usage_report import UsageRow, render_csv, render_json

__all__ = ["Admission", "BaseMeter", "Limits", "Meter", "MeteringSettings", "ModelPrice",
           "RateLimited", "UsageRecord", "UsageRow", "cost_nanos", "cost_usd", "open_meter",
           "open_usage_reader", "price_for", "render_csv", "render_json"]

SQLITE_FILE_NAME = "aigw.sqlite3"  # shared with auth: AuthSettings.sqlite_path


async def open_meter(settings: MeteringSettings, redis: Any | None = None,
                     data_dir: Path = Path(".aigw")) -> BaseMeter:
    """A RedisMeter on `redis` (a redis.asyncio client, not closed by the meter, or a URL, then
    owned), else an EmbeddedMeter on <data_dir>/aigw.sqlite3; a DisabledMeter when
    settings.enabled is False. The client must decode responses (decode_responses=True, as
    AuthServices.redis does). Call `close()` on shutdown, before closing a shared client."""
    if not settings.enabled:
        from gateway.metering.meter import DisabledMeter

        return DisabledMeter(settings)
    if redis is not None:
        from gateway.metering.redis_meter import RedisMeter

        if isinstance(redis, str):
            from infra.redis_client import connect_redis

            return RedisMeter(settings, connect_redis(redis, decode_responses=True),
                              owns_client=True)
        return RedisMeter(settings, redis)
    from gateway.metering.embedded_meter import EmbeddedMeter

    return await EmbeddedMeter.open(settings, Path(data_dir) / SQLITE_FILE_NAME)


async def open_usage_reader(redis: Any | None = None, data_dir: Path = Path(".aigw")) -> BaseMeter:
    """A meter used only to read usage back (admin API, CLI)."""
    return await open_meter(MeteringSettings(), redis=redis, data_dir=data_dir)
