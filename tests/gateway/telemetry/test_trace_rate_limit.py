"""TraceRateLimit: a token bucket over new traces (gateway/telemetry/sampling.py), and how the
setting that makes it is read."""

from __future__ import annotations

import json
import math

import pytest

from gateway.telemetry.sampling import TraceRateLimit
from infra.telemetry.settings import TelemetrySettings


def test_it_starts_full_then_allows_max_per_s_a_second() -> None:
    limit = TraceRateLimit(4.0, now_s=100.0)
    assert [limit.allow(100.0) for _ in range(6)] == [True] * 4 + [False] * 2
    assert not limit.allow(100.2)  # 0.8 of a token refilled
    assert limit.allow(100.25)  # now one
    assert not limit.allow(100.25)
    # over 10 s of steady demand (100 asks a second): 4 a second, spread out
    allowed = [t / 100 for t in range(10_030, 11_030) if limit.allow(t / 100)]
    assert len(allowed) == 40
    gaps = [b - a for a, b in zip(allowed, allowed[1:], strict=False)]
    assert min(gaps) >= 0.2 and max(gaps) <= 0.3


def test_an_idle_gateway_saves_up_at_most_one_seconds_worth() -> None:
    limit = TraceRateLimit(3.0, now_s=0.0)
    for _ in range(3):
        limit.allow(0.0)
    assert sum(limit.allow(3600.0) for _ in range(10)) == 3


def test_a_rate_under_one_a_second_still_lets_one_through() -> None:
    limit = TraceRateLimit(0.5, now_s=0.0)
    assert limit.allow(0.0) and not limit.allow(1.0) and limit.allow(2.0)


def test_a_refund_gives_back_the_token_just_taken_and_never_overfills() -> None:
    limit = TraceRateLimit(2.0, now_s=0.0)
    assert limit.allow(0.0) and limit.allow(0.0) and not limit.allow(0.0)
    limit.refund()
    assert limit.allow(0.0) and not limit.allow(0.0)
    for _ in range(5):
        limit.refund()
    assert sum(limit.allow(0.0) for _ in range(5)) == 2


def test_it_needs_a_positive_rate() -> None:
    with pytest.raises(ValueError):
        TraceRateLimit(0.0, now_s=0.0)


def test_the_setting_defaults_to_100_and_0_means_no_limit() -> None:
    assert TelemetrySettings.from_env(environ={}).max_traces_per_s == 100.0
    assert TelemetrySettings.from_env(environ={"AIGW_TRACE_MAX_PER_S": "0"}).max_traces_per_s == 0.0
    assert (TelemetrySettings.from_env(environ={"AIGW_TRACE_MAX_PER_S": "2.5"}).max_traces_per_s
            == 2.5)
    for bad in ("-1", "nan"):
        with pytest.raises(ValueError):
            TelemetrySettings.from_env(environ={"AIGW_TRACE_MAX_PER_S": bad})


def test_an_infinite_rate_means_no_limit_and_the_dashboard_still_reads_it() -> None:
    """AIGW_TRACE_MAX_PER_S=inf: no limit, as 0. A TraceRateLimit of inf tokens turned NaN on two
    requests in the same clock tick (then never traced again), and the dashboard's overview said
    `"max_new_per_s": Infinity`, which is not JSON (the browser's parse failed: an empty page)."""
    from gateway.dashboard.handlers import _tracing_json

    settings = TelemetrySettings.from_env(environ={"AIGW_TRACE_MAX_PER_S": "inf"})
    assert settings.max_traces_per_s == 0.0
    assert json.loads(json.dumps(_tracing_json(settings), allow_nan=False))["max_new_per_s"] is None
    with pytest.raises(ValueError):
        TraceRateLimit(math.inf, now_s=0.0)
