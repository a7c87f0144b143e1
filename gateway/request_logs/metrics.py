"""/metrics families of the request log (read at scrape time; each worker's own counts).

    aigw_request_logs_written_total              entries stored
    aigw_request_logs_dropped_total{reason}      queue_full | store_error
    aigw_request_logs_queued_bytes               captures waiting to be written
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.request_logs.writer import RequestLog


class RequestLogCollector:
    def __init__(self, request_log: RequestLog) -> None:
        self._log = request_log

    def collect(self) -> Iterator[Metric]:
        written = CounterMetricFamily("aigw_request_logs_written", "Request log entries stored.")
        written.add_metric([], self._log.num_written)
        dropped = CounterMetricFamily("aigw_request_logs_dropped",
                                      "Request log entries dropped, by reason.", labels=["reason"])
        for reason, count in sorted(self._log.num_dropped.items()):
            dropped.add_metric([reason], count)
        queued = GaugeMetricFamily("aigw_request_logs_queued_bytes",
                                   "Request log captures waiting to be written (bytes).")
        queued.add_metric([], self._log.queued_bytes)
        yield from (written, dropped, queued)
