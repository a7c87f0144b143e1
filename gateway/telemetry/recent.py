"""What the dashboard charts, kept in memory: usage per project in time buckets, and a window of
recent latencies for percentiles. Both bounded; both written once per request (at settle/answer).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from gateway.metering.contract import UsageRecord


@dataclass(slots=True)
class UsageBucket:
    num_requests: int = 0
    num_input_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    cost_usd: float = 0.0
    savings_usd: float = 0.0  # what the cached tokens would have cost at the uncached price

    def to_json(self) -> dict[str, float]:
        return {"requests": self.num_requests, "input_tokens": self.num_input_tokens,
                "cached_tokens": self.num_cached_tokens, "output_tokens": self.num_output_tokens,
                "cost_usd": self.cost_usd, "savings_usd": self.savings_usd}


class UsageSeries:
    """project -> {bucket start (unix s) -> UsageBucket}, the last `num_buckets` buckets."""

    def __init__(self, bucket_s: int = 10, num_buckets: int = 360) -> None:
        self.bucket_s = bucket_s
        self._num_buckets = num_buckets
        self._projects: dict[str, dict[int, UsageBucket]] = {}

    def add(self, record: UsageRecord, cache_savings_per_token: float,
            project: str | None = None) -> None:
        """`project`: the series to count it in (default the record's; the telemetry passes
        the project's capped metrics label, so the series are as many as the labels)."""
        start = int(record.created_at) // self.bucket_s * self.bucket_s
        buckets = self._projects.setdefault(record.project if project is None else project, {})
        bucket = buckets.get(start)
        if bucket is None:
            bucket = buckets[start] = UsageBucket()
            oldest = start - self.bucket_s * self._num_buckets
            for stale in [b for b in buckets if b <= oldest]:
                del buckets[stale]
        bucket.num_requests += 1
        bucket.num_input_tokens += record.prompt_tokens
        bucket.num_cached_tokens += record.cached_tokens
        bucket.num_output_tokens += record.completion_tokens
        bucket.cost_usd += record.cost_usd
        bucket.savings_usd += record.cached_tokens * cache_savings_per_token

    def to_json(self, now: float | None = None, num_buckets: int = 60) -> dict[str, object]:
        """Aligned series for the last `num_buckets` buckets (zeros where nothing happened)."""
        now = time.time() if now is None else now
        last = int(now) // self.bucket_s * self.bucket_s
        starts = [last - self.bucket_s * i for i in range(num_buckets - 1, -1, -1)]
        projects = {}
        for project, buckets in sorted(self._projects.items()):
            empty = UsageBucket()
            rows = [(buckets.get(s) or empty).to_json() for s in starts]
            totals = UsageBucket()
            for bucket in buckets.values():
                totals.num_requests += bucket.num_requests
                totals.num_input_tokens += bucket.num_input_tokens
                totals.num_cached_tokens += bucket.num_cached_tokens
                totals.num_output_tokens += bucket.num_output_tokens
                totals.cost_usd += bucket.cost_usd
                totals.savings_usd += bucket.savings_usd
            projects[project] = {"series": {key: [row[key] for row in rows] for key in rows[0]},
                                 "totals": totals.to_json()}
        return {"bucket_s": self.bucket_s, "t": starts, "projects": projects}


@dataclass(slots=True)
class LatencySample:
    at_s: float
    model: str
    latency_s: float
    overhead_s: float | None
    ttft_s: float | None


class LatencyWindow:
    def __init__(self, num_samples: int = 5000) -> None:
        self._samples: deque[LatencySample] = deque(maxlen=num_samples)

    def add(self, sample: LatencySample) -> None:
        self._samples.append(sample)

    def percentiles(self, window_s: float = 300.0, now: float | None = None) -> dict[str, object]:
        now = time.time() if now is None else now
        recent = [s for s in self._samples if s.at_s >= now - window_s]
        return {"window_s": window_s, "num_requests": len(recent),
                "latency_s": _quantiles([s.latency_s for s in recent]),
                "overhead_s": _quantiles([s.overhead_s for s in recent
                                          if s.overhead_s is not None]),
                "ttft_s": _quantiles([s.ttft_s for s in recent if s.ttft_s is not None])}


def _quantiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    ordered = sorted(values)
    last = len(ordered) - 1
    return {f"p{q}": ordered[min(last, round(q / 100 * last))] for q in (50, 90, 99)}
