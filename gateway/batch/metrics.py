"""/metrics families of the Batch API (read at scrape time; this worker's own counts).

    aigw_batch_lines_total{outcome}              lines recorded: completed (their output file) or
                                                 failed (their error file)
    aigw_batch_lines_running                     lines in flight now
    aigw_batch_idle_wait_seconds_total           time a line was ready but waited for idle
                                                 capacity (interactive requests in flight)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


@dataclass
class BatchCounts:
    """Kept by the runner (gateway/batch/runner.py)."""

    num_completed: int = 0
    num_failed: int = 0
    num_running: int = 0
    idle_wait_s: float = 0.0


class BatchCollector:
    def __init__(self) -> None:
        self.counts = BatchCounts()

    def collect(self) -> Iterator[Metric]:
        counts = self.counts
        lines = CounterMetricFamily("aigw_batch_lines", "Batch lines recorded, by outcome.",
                                    labels=["outcome"])
        lines.add_metric(["completed"], counts.num_completed)
        lines.add_metric(["failed"], counts.num_failed)
        yield lines
        yield GaugeMetricFamily("aigw_batch_lines_running", "Batch lines in flight.",
                                value=counts.num_running)
        yield CounterMetricFamily("aigw_batch_idle_wait_seconds", "Time batch lines waited for "
                                  "idle capacity.", value=counts.idle_wait_s)
