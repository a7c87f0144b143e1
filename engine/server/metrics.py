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
    aigw_replica_reserved_share_preemptions_total         counter (of them, taking a reserved share
                                                                   back)
    aigw_replica_flex_promotions_total                    counter (flex requests aged into default)
    aigw_replica_kv_host_tier_hit_tokens_total            counter (of the hit tokens, restored from
                                                                   the second KV tier)
    aigw_replica_kv_host_tier_blocks / _bytes / _budget_bytes      gauge
    aigw_replica_kv_host_tier_offloaded_blocks_total      counter (evicted from the pool into the
                                                                   tier)
    aigw_replica_kv_host_tier_restored_blocks_total       counter (copied back on a prefix hit)
    aigw_replica_kv_host_tier_dropped_blocks_total        counter (gave their slot up to newer ones,
                                                                   or evicted when none was free)
    aigw_replica_requests_total{finish_reason}            counter (engine requests, not HTTP)
    aigw_replica_time_to_first_token_seconds              histogram
    aigw_replica_inter_token_latency_seconds              histogram
    aigw_replica_e2e_request_latency_seconds              histogram
    aigw_replica_cpu_isa{isa, forced, prefill}            gauge 1 (the CPU kernel variant)
    aigw_replica_decode_weights{mode, weights}            gauge 1 (how the replica computes)

Latency targets and classes (engine/admission.py), label service_tier (priority, default, flex):

    aigw_replica_predicted_queue_delay_ms{service_tier}   gauge (work ahead of a new request)
    aigw_replica_step_token_budget                        gauge (the step plan's tokens)
    aigw_replica_step_max_num_running                     gauge (the step plan's running batch cap)
    aigw_replica_prefill_ms_per_token                     gauge (the step-time model's, once
                                                                 measured)
    aigw_replica_ttft_target_ms{service_tier} / aigw_replica_tpot_target_ms   gauge (0: none)
    aigw_replica_ttft_seconds{service_tier}               histogram (per engine request)
    aigw_replica_tpot_seconds{service_tier}               histogram (per request: decode time /
                                                                     (output tokens - 1))
    aigw_replica_admissions_refused_total{service_tier}   counter (429 latency_target)
    aigw_replica_completed_requests_total{service_tier}   counter (finished, not aborted)
    aigw_replica_goodput_requests_total{service_tier}     counter (of those, within both targets)

Every series carries the labels model and replica.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.admission import STANDARD_CLASSES, class_ttft_target_ms, service_tier_of
from engine.outputs import FinishReason, RequestOutput

PREFIX = "aigw_replica_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


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
        # not every engine has it
        computed = getattr(stats, "num_prompt_tokens_computed_total", None)
        if computed is not None:
            yield counter("prompt_tokens_computed",
                          "Prompt tokens prefilled by the model (the rest came "
                          "from the prefix cache; recomputes after preemption count again).",
                          computed)
        yield counter("generation_tokens", "Tokens generated.", stats.num_generation_tokens_total)
        yield counter("prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache.",
                      queried)
        yield counter("prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache.", hit)
        yield gauge("prefix_cache_hit_ratio", "Prefix-cache hit tokens / queried tokens.",
                    hit / queried if queried else 0.0)
        yield counter("preemptions", "Requests preempted for lack of KV blocks.",
                      stats.num_preemptions_total)
        yield counter("reserved_share_preemptions", "Of the preemptions, other projects' requests "
                      "preempted to give a reserved project its share back.",
                      getattr(stats, "num_share_preemptions_total", 0))
        yield counter("flex_promotions", "Flex requests scheduled as default after waiting longer "
                      "than --flex-max-wait-ms.", getattr(stats, "num_flex_promotions_total", 0))
        # not every engine has a tier
        if getattr(stats, "host_tier_budget_bytes", None) is not None:
            yield from _host_tier_metrics(stats, gauge, counter)
        yield from self._slo_metrics(stats, gauge)

    def _slo_metrics(self, stats: Any, gauge: Callable[[str, str, float], Metric]
                     ) -> Iterator[Metric]:
        delays = getattr(stats, "predicted_queue_delay_ms", None)  # not every engine predicts
        if delays is None:
            return
        names, values = [*self._labels, "service_tier"], list(self._labels.values())
        family = GaugeMetricFamily(PREFIX + "predicted_queue_delay_ms", "Predicted queueing delay "
                                   "of a new request of the class, in ms (the work ahead of it: "
                                   "admission control and the gateway's load score).", labels=names)
        for tier, delay_ms in delays if isinstance(delays, tuple) else ():
            family.add_metric([*values, tier], delay_ms)
        yield family
        yield gauge("step_token_budget", "Tokens the current step plan schedules at most "
                    "(--scheduler-policy slo: sized from measured step times).",
                    stats.step_token_budget)
        yield gauge("step_max_num_running", "Sequences the current step plan lets run at once.",
                    stats.max_num_running)
        if getattr(stats, "prefill_ms_per_token", 0.0):
            yield gauge("prefill_ms_per_token",
                        "The measured cost of one prefill token in a step, in "
                        "ms (the step-time model's).", stats.prefill_ms_per_token)


def _host_tier_metrics(stats: Any, gauge: Callable[[str, str, float], Metric],
                       counter: Callable[[str, str, float], Metric]) -> Iterator[Metric]:
    yield counter("kv_host_tier_hit_tokens",
                  "Prompt tokens of the prefix-cache hits that the second "
                  "KV tier served (restored, not recomputed).", stats.num_host_tier_hit_tokens)
    yield gauge("kv_host_tier_blocks", "KV blocks the second tier holds.",
                stats.num_host_tier_blocks)
    yield gauge("kv_host_tier_bytes", "Bytes of the KV blocks the second tier holds.",
                stats.num_host_tier_bytes)
    yield gauge("kv_host_tier_budget_bytes", "The second KV tier's budget (0: none).",
                stats.host_tier_budget_bytes)
    yield counter("kv_host_tier_offloaded_blocks",
                  "KV blocks evicted from the pool into the second "
                  "tier.", stats.num_host_tier_offloaded_blocks_total)
    yield counter("kv_host_tier_restored_blocks", "KV blocks the second tier copied back into the "
                  "pool on a prefix hit.", stats.num_host_tier_restored_blocks_total)
    yield counter("kv_host_tier_dropped_blocks",
                  "KV blocks the second tier let go: entries that gave "
                  "their slot up to newer blocks, evicted blocks that found no free slot.",
                  stats.num_host_tier_dropped_blocks_total)


class ReplicaMetrics:
    """Owns one registry; `track(start, priority)` gives a per-engine-request latency observer.
    `ttft_target_ms` / `tpot_target_ms`: the replica's targets (None: none), which goodput and the
    target gauges use."""

    def __init__(self, read_stats: Callable[[], Any], *, model: str, replica: str,
                 ttft_target_ms: float | None = None, tpot_target_ms: float | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model": model, "replica": replica}
        self.registry.register(_EngineStatsCollector(read_stats, labels))
        self.ttft_target_ms, self.tpot_target_ms = ttft_target_ms, tpot_target_ms
        label_names = list(labels)
        tier_labels = [*label_names, "service_tier"]
        self._class_ttft = Histogram(PREFIX + "ttft_seconds", "Time to first token by class.",
                                     tier_labels, buckets=_TTFT_BUCKETS, registry=self.registry)
        self._class_tpot = Histogram(PREFIX + "tpot_seconds", "Time per output token by class (a "
                                     "request's decode time / its output tokens after the first).",
                                     tier_labels, buckets=_TPOT_BUCKETS, registry=self.registry)
        self._refused = Counter(PREFIX + "admissions_refused", "Requests refused at once (429 "
                                "latency_target): their predicted queueing broke the class's TTFT "
                                "target.", tier_labels, registry=self.registry)
        self._completed = Counter(PREFIX + "completed_requests", "Engine requests finished (not "
                                  "aborted), by class.", tier_labels, registry=self.registry)
        self._goodput = Counter(PREFIX + "goodput_requests", "Finished engine requests within both "
                                "latency targets (TTFT and TPOT; a target not set always holds).",
                                tier_labels, registry=self.registry)
        self._targets(label_names, labels)
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
        self._decode_weights = Gauge(
            PREFIX + "decode_weights", "How this replica computes: the decode-weights mode (q4 / "
            "float) and the weights it runs on (q4-native, q4-int4, float32, ...).",
            [*label_names, "mode", "weights"], registry=self.registry)
        self._cpu_isa = Gauge(
            PREFIX + "cpu_isa",
            "The CPU kernel variant chosen at start-up (avx2, avx512, avx_vnni, "
            "avx512_vnni; none: the native kernels are off), forced or not by AIGW_CPU_ISA, and "
            "what prompt rows run on (amx_bf16, avx512_bf16: bf16 GEMMs; none: what decode rows "
            "run on).",
            [*label_names, "isa", "forced", "prefill"], registry=self.registry)

    def _targets(self, label_names: list[str], labels: dict[str, str]) -> None:
        """The targets as gauges (0: no target)."""
        ttft = Gauge(PREFIX + "ttft_target_ms", "The class's TTFT target admission holds it to "
                     "(--ttft-p90-ms; flex: 4x; 0: none).", [*label_names, "service_tier"],
                     registry=self.registry)
        for priority in STANDARD_CLASSES:
            ttft.labels(**labels, service_tier=service_tier_of(priority)).set(
                class_ttft_target_ms(self.ttft_target_ms, priority) or 0.0)
        Gauge(PREFIX + "tpot_target_ms", "The TPOT target (--tpot-p90-ms; 0: none).", label_names,
              registry=self.registry).labels(**labels).set(self.tpot_target_ms or 0.0)

    def count_refused(self, priority: int) -> None:
        self._refused.labels(**self._labels, service_tier=service_tier_of(priority)).inc()

    def set_compute_info(self, info: dict[str, Any] | None) -> None:
        """aigw_replica_cpu_isa{isa, forced, prefill} 1: the CPU kernel variant chosen at start-up
        (engine/kernels/cpu/isa.py; isa="none" when the native kernels are off; prefill: the bf16
        prefill ISA or "none"), and
        aigw_replica_decode_weights{mode, weights} 1 (ModelRunner.compute_info)."""
        if not info:
            return
        self._decode_weights.labels(**self._labels, mode=str(info.get("decode_weights")),
                                    weights=str(info.get("weights"))).set(1)
        if "cpu_isa" in info:
            self._cpu_isa.labels(**self._labels, isa=str(info["cpu_isa"] or "none"),
                                 forced=str(bool(info.get("cpu_isa_forced"))).lower(),
                                 prefill=str(info.get("cpu_prefill_isa") or "none")).set(1)

    def count_prompt_render(self, by: str) -> None:
        """`by`: "gateway" (its prompt_token_ids were used) or "replica" (rendered here)."""
        self._prompt_renders.labels(**self._labels, by=by).inc()

    def track(self, start: float | None = None, priority: int = 0) -> RequestLatency:
        return RequestLatency(self, time.perf_counter() if start is None else start, priority)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestLatency:
    """Observes TTFT on the first output, ITL per later token, e2e and the finish reason."""

    def __init__(self, metrics: ReplicaMetrics, start: float, priority: int = 0) -> None:
        self._metrics = metrics
        self._start = start
        self._tier = service_tier_of(priority)
        self._ttft_target_ms = class_ttft_target_ms(metrics.ttft_target_ms, priority)
        self._first: float | None = None
        self._last: float | None = None
        self._num_tokens = 0
        self._is_finished = False

    def observe(self, output: RequestOutput) -> None:
        now = time.perf_counter()
        labels = self._metrics._labels
        if output.new_token_ids:
            self._num_tokens += len(output.new_token_ids)
            if self._last is None:
                self._first = now
                self._metrics._ttft.labels(**labels).observe(now - self._start)
                self._metrics._class_ttft.labels(**labels, service_tier=self._tier).observe(
                    now - self._start)
            else:
                per_token = (now - self._last) / len(output.new_token_ids)
                itl = self._metrics._itl.labels(**labels)
                for _ in output.new_token_ids:
                    itl.observe(per_token)
            self._last = now
        if output.finish_reason is not None:
            self._finish(str(output.finish_reason), now)
            if output.finish_reason != FinishReason.ABORT:
                self._settle_class()

    def _settle_class(self) -> None:
        """The class's TPOT, completion and goodput (both targets met) of a finished request."""
        metrics, labels = self._metrics, {**self._metrics._labels, "service_tier": self._tier}
        ttft_s = (self._first - self._start) if self._first is not None else None
        tpot_s = None
        if self._first is not None and self._last is not None and self._num_tokens > 1:
            tpot_s = (self._last - self._first) / (self._num_tokens - 1)
            metrics._class_tpot.labels(**labels).observe(tpot_s)
        metrics._completed.labels(**labels).inc()
        ttft_ok = (not self._ttft_target_ms or ttft_s is None
                   or ttft_s * 1000.0 <= self._ttft_target_ms)
        tpot_ok = (not metrics.tpot_target_ms or tpot_s is None
                   or tpot_s * 1000.0 <= metrics.tpot_target_ms)
        if ttft_ok and tpot_ok:
            metrics._goodput.labels(**labels).inc()

    def observe_abort(self) -> None:
        """The request ended without a final output (its caller went away): the engine aborts it."""
        if not self._is_finished:
            self._finish(str(FinishReason.ABORT), time.perf_counter())

    def _finish(self, finish_reason: str, now: float) -> None:
        self._is_finished = True
        labels = self._metrics._labels
        self._metrics._e2e.labels(**labels).observe(now - self._start)
        self._metrics._finished.labels(**labels, finish_reason=finish_reason).inc()
