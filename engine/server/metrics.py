"""The replica's Prometheus metrics, in a per-app CollectorRegistry (never the global one).

Engine state (running/waiting requests, KV blocks, token and preemption totals, prefix-cache
counters) is read from `engine.stats()` at scrape time by a collector; latencies are observed by
the server as outputs stream out:

    aigw_replica_num_requests_running / _waiting          gauge
    aigw_replica_kv_blocks_used / _total (/ _cached, _retained)  gauge
    aigw_replica_prompt_tokens_total                      counter
    aigw_replica_generation_tokens_total                  counter
    aigw_replica_prefix_cache_queried_tokens_total        counter
    aigw_replica_prefix_cache_hit_tokens_total            counter
    aigw_replica_prefix_cache_hit_ratio                   gauge (hit / queried, 0 when none)
    aigw_replica_preemptions_total                        counter
    aigw_replica_kv_host_tier_hit_tokens_total            counter (of the hit tokens, restored from
                                                                   the second KV tier)
    aigw_replica_kv_host_tier_blocks / _bytes / _budget_bytes      gauge
    aigw_replica_kv_host_tier_offloaded_blocks_total      counter (evicted from the pool into the tier)
    aigw_replica_kv_host_tier_restored_blocks_total       counter (copied back on a prefix hit)
    aigw_replica_kv_host_tier_dropped_blocks_total        counter (gave their slot up to newer ones,
                                                                   or evicted when none was free)
    aigw_replica_requests_total{finish_reason}            counter (engine requests, not HTTP)
    aigw_replica_time_to_first_token_seconds              histogram
    aigw_replica_inter_token_latency_seconds              histogram
    aigw_replica_e2e_request_latency_seconds              histogram

Every series carries the labels model and replica.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.outputs import FinishReason, RequestOutput

PREFIX = "aigw_replica_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class _EngineStatsCollector(Collector):
    def __init__(self, read_stats: Callable[[], Any], labels: dict[str, str]) -> None:
        self._read_stats = read_stats
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        stats = self._read_stats()
        names, values = list(self._labels), list(self._labels.values())

        def gauge(name: str, doc: str, value: float) -> Metric:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=names)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> Metric:
            family = CounterMetricFamily(PREFIX + name, doc, labels=names)
            family.add_metric(values, value)
            return family

        queried = stats.num_prefix_cache_queried_tokens
        hit = stats.num_prefix_cache_hit_tokens
        yield gauge("num_requests_running", "Requests in the running batch.",
                    stats.num_running_requests)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.",
                    stats.num_waiting_requests)
        yield gauge("kv_blocks_used", "KV cache blocks in use.", stats.num_kv_blocks_used)
        yield gauge("kv_blocks_total", "KV cache blocks in the pool.", stats.num_kv_blocks_total)
        num_cached = getattr(stats, "num_kv_blocks_cached", None)  # not every engine reports it
        if num_cached is not None:
            yield gauge("kv_blocks_cached", "KV blocks holding prefix-cache content.",
                        num_cached)
        num_retained = getattr(stats, "num_kv_blocks_retained", None)
        if num_retained is not None:
            yield gauge("kv_blocks_retained", "KV blocks finished requests keep from eviction "
                        "(KV retention: cache_control ttl, prompt_cache_retention, sessions).",
                        num_retained)
        yield counter("prompt_tokens", "Prompt tokens processed.", stats.num_prompt_tokens_total)
        computed = getattr(stats, "num_prompt_tokens_computed_total", None)  # not every engine has it
        if computed is not None:
            yield counter("prompt_tokens_computed", "Prompt tokens prefilled by the model (the rest came "
                          "from the prefix cache; recomputes after preemption count again).", computed)
        yield counter("generation_tokens", "Tokens generated.", stats.num_generation_tokens_total)
        yield counter("prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache.",
                      queried)
        yield counter("prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache.", hit)
        yield gauge("prefix_cache_hit_ratio", "Prefix-cache hit tokens / queried tokens.",
                    hit / queried if queried else 0.0)
        yield counter("preemptions", "Requests preempted for lack of KV blocks.",
                      stats.num_preemptions_total)
        if getattr(stats, "host_tier_budget_bytes", None) is not None:  # not every engine has a tier
            yield from _host_tier_metrics(stats, gauge, counter)


def _host_tier_metrics(stats: Any, gauge: Callable[[str, str, float], Metric],
                       counter: Callable[[str, str, float], Metric]) -> Iterator[Metric]:
    yield counter("kv_host_tier_hit_tokens", "Prompt tokens of the prefix-cache hits that the second "
                  "KV tier served (restored, not recomputed).", stats.num_host_tier_hit_tokens)
    yield gauge("kv_host_tier_blocks", "KV blocks the second tier holds.", stats.num_host_tier_blocks)
    yield gauge("kv_host_tier_bytes", "Bytes of the KV blocks the second tier holds.",
                stats.num_host_tier_bytes)
    yield gauge("kv_host_tier_budget_bytes", "The second KV tier's budget (0: none).",
                stats.host_tier_budget_bytes)
    yield counter("kv_host_tier_offloaded_blocks", "KV blocks evicted from the pool into the second "
                  "tier.", stats.num_host_tier_offloaded_blocks_total)
    yield counter("kv_host_tier_restored_blocks", "KV blocks the second tier copied back into the "
                  "pool on a prefix hit.", stats.num_host_tier_restored_blocks_total)
    yield counter("kv_host_tier_dropped_blocks", "KV blocks the second tier let go: entries that gave "
                  "their slot up to newer blocks, evicted blocks that found no free slot.",
                  stats.num_host_tier_dropped_blocks_total)


class ReplicaMetrics:
    """Owns one registry; `track(start)` gives a per-engine-request latency observer."""

    def __init__(self, read_stats: Callable[[], Any], *, model: str, replica: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model": model, "replica": replica}
        self.registry.register(_EngineStatsCollector(read_stats, labels))
        label_names = list(labels)
        self._ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.",
                               label_names, buckets=_TTFT_BUCKETS, registry=self.registry)
        self._itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between tokens.",
                              label_names, buckets=_ITL_BUCKETS, registry=self.registry)
        self._e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency.",
                              label_names, buckets=_E2E_BUCKETS, registry=self.registry)
        self._finished = Counter(PREFIX + "requests", "Engine requests finished.",
                                 [*label_names, "finish_reason"], registry=self.registry)
        self._prompt_renders = Counter(
            PREFIX + "prompt_renders", "Chat prompts by who rendered them: the gateway (its token "
            "ids used) or this replica.", [*label_names, "by"], registry=self.registry)
        self._labels = labels

    def count_prompt_render(self, by: str) -> None:
        """`by`: "gateway" (its prompt_token_ids were used) or "replica" (rendered here)."""
        self._prompt_renders.labels(**self._labels, by=by).inc()

    def track(self, start: float | None = None) -> RequestLatency:
        return RequestLatency(self, time.perf_counter() if start is None else start)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestLatency:
    """Observes TTFT on the first output, ITL per later token, e2e and the finish reason."""

    def __init__(self, metrics: ReplicaMetrics, start: float) -> None:
        self._metrics = metrics
        self._start = start
        self._last: float | None = None
        self._is_finished = False

    def observe(self, output: RequestOutput) -> None:
        now = time.perf_counter()
        labels = self._metrics._labels
        if output.new_token_ids:
            if self._last is None:
                self._metrics._ttft.labels(**labels).observe(now - self._start)
            else:
                per_token = (now - self._last) / len(output.new_token_ids)
                itl = self._metrics._itl.labels(**labels)
                for _ in output.new_token_ids:
                    itl.observe(per_token)
            self._last = now
        if output.finish_reason is not None:
            self._finish(str(output.finish_reason), now)

    def observe_abort(self) -> None:
        """The request ended without a final output (its caller went away): the engine aborts it."""
        if not self._is_finished:
            self._finish(str(FinishReason.ABORT), time.perf_counter())

    def _finish(self, finish_reason: str, now: float) -> None:
        self._is_finished = True
        labels = self._metrics._labels
        self._metrics._e2e.labels(**labels).observe(now - self._start)
        self._metrics._finished.labels(**labels, finish_reason=finish_reason).inc()
