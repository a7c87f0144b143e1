"""/metrics families of the request log (read at scrape time; each worker's own counts).

    aigw_request_logs_written_total              entries stored
    aigw_request_logs_dropped_total{reason}      queue_full | store_error | build_error
    aigw_request_logs_queued_bytes               captures waiting to be written
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.request_logs.writer import RequestLog


class RequestLogCollector:
    """`request_log` is set by the served app (until then: zeros)."""

    def __init__(self, request_log: RequestLog | None = None) -> None:
        self.request_log = request_log

    def collect(self) -> Iterator[Metric]:
        source = self.request_log
        written = CounterMetricFamily("aigw_request_logs_written", "Request log entries stored.")
        written.add_metric([], source.num_written if source is not None else 0)
        dropped = CounterMetricFamily("aigw_request_logs_dropped",
                                      "Request log entries dropped, by reason.", labels=["reason"])
        for reason, count in sorted((source.num_dropped if source is not None else {}).items()):
            dropped.add_metric([reason], count)
        queued = GaugeMetricFamily("aigw_request_logs_queued_bytes",
                                   "Request log captures waiting to be written (bytes).")
        queued.add_metric([], source.queued_bytes if source is not None else 0)
        yield from (written, dropped, queued)
