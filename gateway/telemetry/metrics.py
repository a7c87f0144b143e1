"""The gateway's Prometheus metrics, on a per-app CollectorRegistry (served at GET /metrics).

    aigw_requests_total{route,status,model,project}            every answered request
    aigw_request_duration_seconds{route,model}                 end to end, streams until the end
    aigw_overhead_seconds{route}                               added by the gateway
                                                               (x-aigw-overhead-ms)
    aigw_time_to_first_token_seconds{model}                    streams: request in -> first upstream
                                                               event
    aigw_{input,cached,output}_tokens_total{model,project}     usage as settled with the meter
    aigw_cost_usd_total{model,project}
    aigw_prompt_cache_hit_ratio{project}                       cached / input tokens, from the two
                                                               counters when scraped
    aigw_routing_decisions_total{policy,reason,replica}
    aigw_fallbacks_total{model,fallback,reason}               hops down a model's fallback chain
    aigw_latency_refusals_total{model,service_tier,outcome}   replicas' latency_target 429s:
                                                               outcome retried (the next-best
                                                               endpoint tried) or passed_on
                                                               (to a fallback model or the client)
    aigw_batch_lines_total{outcome}, aigw_batch_lines_running, aigw_batch_idle_wait_seconds_total
                                                               the Batch API
                                                               (gateway/batch/metrics.py)
    aigw_embedded_replica_restarts_total{endpoint}             `aigw serve`'s replicas restarted
                                                               after their process exited
    aigw_endpoint_{healthy,breaker_open,outstanding_requests,
                   requests_running,requests_waiting,kv_usage_ratio}{model,endpoint}
    aigw_endpoint_predicted_queue_delay_ms{model,endpoint,service_tier}
                                                               read from the Fleet at scrape time

Model and project are "" for requests refused before admission (failed auth, bad body, unknown
model); from admission on (a 429 included) they are the configured model and the caller's project.
Projects come from API keys and from a trusted issuer's JWT `project` claims, which the gateway
does not bound: the first `metrics_max_projects` distinct ones (per process) keep their own label
value, every later one is counted under `_other` (ProjectLabels), so the series stay bounded.
The request path reaches label children through `child(metric, *labels)`-style caches
(`LabelCache`), so prometheus_client's `labels()` runs once per label tuple, not per request.
(Writing the children's numbers lock-free through prometheus_client's private fields saved ~3.5 us
a request, under 1% of the gateway's CPU: not worth depending on a library's internals.)

Several worker processes (`aigw serve --workers N`, which sets PROMETHEUS_MULTIPROC_DIR for them
unless it is set already) use prometheus_client's multiprocess mode: each process writes its
numbers to files there, and a scrape, whichever worker it reaches, sums all of them
(`MultiProcessCollector`). Without it each worker answered with its own counters, so successive
scrapes went up and down and Prometheus read every drop as a counter reset. The endpoint gauges
are each worker's own view (every worker checks every endpoint).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from gateway.fleet.endpoints import Fleet
from gateway.fleet.supervisor import restarts_collector_from_env
from gateway.metering.contract import UsageRecord

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class LabelCache(dict[tuple[str, ...], Any]):
    """`cache[labels]` (or `cache(*labels)`) is `metric.labels(*labels)`, looked up once per
    distinct label tuple (the children live as long as the metric does, exactly as
    prometheus_client keeps them). The request path indexes it: a dict lookup in C, no Python
    call; `labels()` runs in `__missing__`, once."""

    __slots__ = ("_metric",)

    def __init__(self, metric: Any) -> None:
        super().__init__()
        self._metric = metric

    def __missing__(self, labels: tuple[str, ...]) -> Any:
        child = self[labels] = self._metric.labels(*labels)
        return child

    def __call__(self, *labels: str) -> Any:
        return self[labels]


OTHER_PROJECTS = "_other"  # the label value of every project past the first max_projects


class ProjectLabels(dict[str, str]):
    """`labels[project]` (or `labels(project)`): the project's own name for the first
    `max_projects` distinct projects seen ("" is not one: no project yet), OTHER_PROJECTS for
    every later one. A project seen before is a dict lookup in C, no Python call; `__missing__`
    decides a new one (at most `max_projects` are kept, plus "")."""

    __slots__ = ("max_projects",)

    def __init__(self, max_projects: int) -> None:
        super().__init__({"": ""})
        self.max_projects = max_projects

    def __missing__(self, project: str) -> str:
        if len(self) - 1 < self.max_projects:  # (less "")
            self[project] = project
            return project
        return OTHER_PROJECTS

    def __call__(self, project: str) -> str:
        return self[project]


class GatewayMetrics:
    def __init__(self, max_projects: int = 1000) -> None:
        self.project_label = ProjectLabels(max_projects)
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("aigw_requests", "Requests answered by the gateway.",
                                ["route", "status", "model", "project"], registry=r)
        self.duration = Histogram("aigw_request_duration_seconds", "Request latency, end to end.",
                                  ["route", "model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.overhead = Histogram("aigw_overhead_seconds", "Time added by the gateway itself.",
                                  ["route"], buckets=_OVERHEAD_BUCKETS, registry=r)
        self.ttft = Histogram("aigw_time_to_first_token_seconds", "Streams: time to first token.",
                              ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        usage_labels = ["model", "project"]
        self.input_tokens = Counter("aigw_input_tokens", "Prompt tokens.", usage_labels, registry=r)
        self.cached_tokens = Counter("aigw_cached_tokens",
                                     "Prompt tokens served from the prompt cache.",
                                     usage_labels, registry=r)
        self.output_tokens = Counter("aigw_output_tokens", "Completion tokens.", usage_labels,
                                     registry=r)
        self.cost = Counter("aigw_cost_usd", "Cost in US dollars.", usage_labels, registry=r)
        self.routing_decisions = Counter("aigw_routing_decisions", "Endpoint picks by the router.",
                                         ["policy", "reason", "replica"], registry=r)
        self.fallbacks = Counter("aigw_fallbacks", "Requests handed to a fallback model before "
                                 "their first token, by reason.", ["model", "fallback", "reason"],
                                 registry=r)
        self.latency_refusals = Counter(
            "aigw_latency_refusals", "Replica admission refusals (429 latency_target: the "
            "predicted queueing would break the TTFT target), by what the gateway did next.",
            ["model", "service_tier", "outcome"], registry=r)
        self._fleet_collector: FleetCollector | None = None
        # families other packages keep, read at scrape time (their sources are set by the app)
        from gateway.guardrails.metrics import GuardrailCollector
        from gateway.request_logs.metrics import RequestLogCollector

        self.guardrails = GuardrailCollector()  # aigw_guardrail_*
        self.request_logs = RequestLogCollector()  # aigw_request_logs_*
        self.extra_collectors: list[Any] = [self.guardrails, self.request_logs]
        # `aigw serve`'s embedded replicas: restart counts from the supervisor
        # (gateway/fleet/supervisor.py)
        self._restarts_collector = restarts_collector_from_env()
        from gateway.batch.metrics import BatchCollector  # aigw_batch_* (counts set by the app)

        self.batch = BatchCollector()
        # what a scrape reads the metrics above from: this registry, or every worker's files
        self._source: Any = r
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            self._source = CollectorRegistry()
            MultiProcessCollector(self._source)  # type: ignore[no-untyped-call]
        # request-path accessors: labels() once per label tuple
        self.requests_of = LabelCache(self.requests)
        self.duration_of = LabelCache(self.duration)
        self.overhead_of = LabelCache(self.overhead)
        self.ttft_of = LabelCache(self.ttft)
        self.routing_decisions_of = LabelCache(self.routing_decisions)
        self.fallbacks_of = LabelCache(self.fallbacks)
        self.latency_refusals_of = LabelCache(self.latency_refusals)
        self._usage_children: dict[tuple[str, str], tuple[Any, Any, Any, Any]] = {}
        self._input_tokens_of = LabelCache(self.input_tokens)
        self._cached_tokens_of = LabelCache(self.cached_tokens)
        self._output_tokens_of = LabelCache(self.output_tokens)
        self._cost_of = LabelCache(self.cost)

    def attach_fleet(self, fleet: Fleet) -> None:
        self._fleet_collector = FleetCollector(fleet)

    def observe_usage(self, record: UsageRecord) -> None:
        labels = (record.model, self.project_label[record.project])
        children = self._usage_children.get(labels)
        if children is None:
            children = self._usage_children[labels] = (
                self._input_tokens_of(*labels), self._cached_tokens_of(*labels),
                self._output_tokens_of(*labels), self._cost_of(*labels))
        input_tokens, cached_tokens, output_tokens, cost = children
        # (a zero is not added: an inc is five Python calls, and the child exists already)
        if record.prompt_tokens:
            input_tokens.inc(record.prompt_tokens)
        if record.cached_tokens:
            cached_tokens.inc(record.cached_tokens)
        if record.completion_tokens:
            output_tokens.inc(record.completion_tokens)
        if record.cost_usd:
            cost.inc(record.cost_usd)

    def collect(self, per_project: bool = True) -> list[Metric]:
        """Every family /metrics serves (the registry interface `generate_latest` reads);
        without `per_project`, each family's `project` label is summed away (and the cache hit
        ratio is one figure over all projects)."""
        families = list(self._source.collect())
        if self._fleet_collector is not None:
            families.extend(self._fleet_collector.collect())
        families.extend(self._restarts_collector.collect())
        families.extend(self.batch.collect())
        for collector in self.extra_collectors:
            families.extend(collector.collect())
        if not per_project:
            families = [_summed_over_projects(family) for family in families]
        families.append(_cache_hit_ratio(families, per_project))
        return families

    def render(self, per_project: bool = True) -> bytes:
        return generate_latest(_View(self, per_project))


class _View:
    """The registry interface over one choice of `per_project`."""

    def __init__(self, metrics: GatewayMetrics, per_project: bool) -> None:
        self._metrics = metrics
        self._per_project = per_project

    def collect(self) -> list[Metric]:
        return self._metrics.collect(self._per_project)


def _summed_over_projects(family: Metric) -> Metric:
    """`family` with its samples' `project` label dropped and the values of samples that then
    coincide added up (counters and histogram buckets stay counters and buckets); a `_created`
    sample is a timestamp, so the earliest one is kept, not their sum."""
    if not any("project" in sample.labels for sample in family.samples):
        return family
    sums: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for sample in family.samples:
        labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "project"))
        key = (sample.name, labels)
        if key not in sums:
            sums[key] = sample.value
        elif sample.name.endswith("_created"):
            sums[key] = min(sums[key], sample.value)
        else:
            sums[key] += sample.value
    summed = Metric(family.name, family.documentation, family.type, family.unit)
    for (name, labels), value in sums.items():
        summed.add_sample(name, dict(labels), value)
    return summed


def _cache_hit_ratio(families: list[Metric], per_project: bool = True) -> Metric:
    """aigw_prompt_cache_hit_ratio{project}: cached / input tokens over all models, from the
    token counters as scraped (so it is right across workers too); one unlabelled figure over
    every project without `per_project`."""
    tokens: dict[str, list[float]] = {}  # project -> [input, cached]
    for family in families:
        column = {"aigw_input_tokens": 0, "aigw_cached_tokens": 1}.get(family.name)
        if column is None:
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                project = sample.labels.get("project", "") if per_project else ""
                tokens.setdefault(project, [0.0, 0.0])[column] += sample.value
    ratio = GaugeMetricFamily("aigw_prompt_cache_hit_ratio",
                              "Cached / prompt tokens per project since start.",
                              labels=["project"] if per_project else [])
    for project, (num_input, num_cached) in sorted(tokens.items()):
        if num_input:
            ratio.add_metric([project] if per_project else [], num_cached / num_input)
    return ratio


class FleetCollector(Collector):
    """Endpoint state as gauges, read when scraped (nothing on the request path)."""

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def collect(self) -> Iterator[Metric]:
        labels = ["model", "endpoint"]
        families = {name: GaugeMetricFamily("aigw_endpoint_" + name, doc, labels=labels)
                    for name, doc in (
                        ("healthy", "1 if the last active health check passed."),
                        ("breaker_open", "1 if the circuit breaker keeps the endpoint out."),
                        ("outstanding_requests", "Requests in flight from this gateway."),
                        ("requests_running", "Requests the endpoint reports running."),
                        ("requests_waiting", "Requests the endpoint reports queued."),
                        ("kv_usage_ratio", "KV cache blocks used / total, as reported."))}
        now = time.monotonic()
        for route, endpoint in self._fleet.all_endpoints():
            values = [route.settings.name, endpoint.name]
            families["healthy"].add_metric(values, float(endpoint.is_healthy))
            families["breaker_open"].add_metric(values,
                                                float(not endpoint.breaker.can_attempt(now)))
            families["outstanding_requests"].add_metric(values, float(endpoint.num_outstanding))
            load = endpoint.load
            if load is None:
                continue
            if load.num_requests_running is not None:
                families["requests_running"].add_metric(values, float(load.num_requests_running))
            if load.num_requests_waiting is not None:
                families["requests_waiting"].add_metric(values, float(load.num_requests_waiting))
            if load.num_kv_blocks_used is not None and load.num_kv_blocks_total:
                families["kv_usage_ratio"].add_metric(
                    values, load.num_kv_blocks_used / load.num_kv_blocks_total)
        delays = GaugeMetricFamily(
            "aigw_endpoint_predicted_queue_delay_ms", "The replica's predicted queueing delay "
            "for a request of each class, as reported (ms).", labels=[*labels, "service_tier"])
        for route, endpoint in self._fleet.all_endpoints():
            reported = endpoint.load.predicted_queue_delay_ms if endpoint.load else None
            for tier, delay_ms in sorted((reported or {}).items()):
                delays.add_metric([route.settings.name, endpoint.name, tier], delay_ms)
        yield from families.values()
        yield delays
