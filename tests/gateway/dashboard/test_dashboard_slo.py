"""The dashboard's latency-target panel from replicas' /metrics text: per-class histograms summed
over a model's replicas, p90 interpolated as histogram_quantile does, targets from the replica or
the model's settings, goodput and refusal rates between two polls; junk lines are skipped."""

from __future__ import annotations

import pytest

from gateway.dashboard.slo import SloRates, bucket_quantile, parse_slo, slo_rows


def _replica(ttft_counts: tuple[int, int, int], refused: int, goodput: int, completed: int) -> str:
    """A replica's series: TTFT buckets le=0.1, 0.5, +Inf (cumulative), one TPOT sample."""
    lines = [f'aigw_replica_ttft_seconds_bucket{{model="m",replica="r",service_tier="default",'
             f'le="{le}"}} {count}' for le, count in zip(("0.1", "0.5", "+Inf"), ttft_counts,
                                                         strict=True)]
    lines += ['aigw_replica_tpot_seconds_bucket{model="m",replica="r",service_tier="default",'
              'le="0.05"} 1', 'aigw_replica_tpot_seconds_bucket{model="m",replica="r",'
              'service_tier="default",le="+Inf"} 1',
              f'aigw_replica_admissions_refused_total{{model="m",service_tier="default"}} '
              f'{refused}',
              f'aigw_replica_goodput_requests_total{{model="m",service_tier="default"}} {goodput}',
              f'aigw_replica_completed_requests_total{{model="m",service_tier="default"}} '
              f'{completed}',
              'aigw_replica_ttft_target_ms{model="m",service_tier="default"} 400',
              'aigw_replica_ttft_seconds_bucket{service_tier="bogus",le="1"} 5',
              'aigw_replica_goodput_requests_total{service_tier="flex"} nan',
              'garbage line', '# HELP aigw_replica_ttft_seconds x']
    return "\n".join(lines)


def test_quantiles_interpolate_inside_the_bucket() -> None:
    assert bucket_quantile(0.9, {0.1: 5, 0.5: 10, float("inf"): 10}) == pytest.approx(0.42)
    assert bucket_quantile(0.5, {0.1: 5, 0.5: 10, float("inf"): 10}) == pytest.approx(0.1)
    assert bucket_quantile(0.9, {0.1: 0, float("inf"): 4}) == 0.1  # in +Inf: the last bound
    assert bucket_quantile(0.9, {0.1: 0, float("inf"): 0}) is None


def test_rows_sum_replicas_compare_with_targets_and_rate_between_polls() -> None:
    figures = parse_slo(_replica((2, 4, 5), 1, 4, 5))
    assert set(figures) == {"default"}  # (no "bogus" class; flex's nan is skipped)
    assert figures["default"].counts == {"refused": 1.0, "goodput": 4.0, "completed": 5.0}
    rates = SloRates()
    texts = [_replica((2, 4, 5), 1, 4, 5), _replica((3, 5, 5), 0, 5, 5)]
    rows = slo_rows([("m", 1000.0, 30.0, texts)], rates, now=100.0)
    assert len(rows) == 1
    row = rows[0]
    # summed: le=0.1: 5, le=0.5: 9, +Inf: 10 -> p90 at the bucket's top
    assert row["ttft_p90_s"] == pytest.approx(0.5)
    assert row["ttft_target_ms"] == 400.0  # the replica's own, over the settings' 1000
    assert row["ttft_within"] is False
    assert row["tpot_target_ms"] == 30.0 and row["tpot_within"] is False  # 50 ms > 30 ms
    assert (row["completed"], row["goodput"], row["goodput_ratio"], row["refused"]) == (
        10.0, 9.0, 0.9, 1.0)
    assert row["goodput_per_s"] is None  # the first poll has nothing to compare with
    later = [_replica((2, 4, 5), 3, 6, 7), _replica((3, 5, 5), 0, 5, 5)]
    row = slo_rows([("m", 1000.0, 30.0, later)], rates, now=102.0)[0]
    assert (row["goodput_per_s"], row["refused_per_s"]) == (1.0, 1.0)
    assert slo_rows([("m", 1000.0, None, [])], rates, now=103.0) == []  # no replica reports
