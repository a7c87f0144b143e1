"""The dashboard's latency-target panel: per model and class (service_tier), TTFT and TPOT p90
against the targets, goodput and refusals, from the replicas' /metrics (engine/server/metrics.py):

    aigw_replica_ttft_seconds / aigw_replica_tpot_seconds {service_tier}   histograms
    aigw_replica_completed_requests_total / _goodput_requests_total {service_tier}
    aigw_replica_admissions_refused_total {service_tier}
    aigw_replica_ttft_target_ms {service_tier}, aigw_replica_tpot_target_ms

Percentiles are over each replica's life (its histograms, summed over a model's replicas,
interpolated inside a bucket as Prometheus' histogram_quantile does); goodput and refusals per
second are over the time since the previous dashboard poll (`SloRates`, per gateway process).
A target the replicas do not report comes from the model's settings (ttft_p90_ms, tpot_p90_ms).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

TIERS = ("priority", "default", "flex")
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+"
                     r"(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_HISTOGRAMS = {"ttft_seconds_bucket": "ttft", "tpot_seconds_bucket": "tpot"}
_COUNTERS = {"completed_requests_total": "completed", "goodput_requests_total": "goodput",
             "admissions_refused_total": "refused"}
_TARGETS = {"ttft_target_ms": "ttft_target_ms", "tpot_target_ms": "tpot_target_ms"}
MAX_BUCKETS = 64  # per histogram and class: a replica's own buckets are ~15


@dataclass
class ClassFigures:
    """One class's figures of one model, summed over its replicas."""

    buckets: dict[str, dict[float, float]] = field(default_factory=lambda: {"ttft": {}, "tpot": {}})
    counts: dict[str, float] = field(default_factory=dict)
    targets_ms: dict[str, float] = field(default_factory=dict)


def parse_slo(metrics_text: str, into: dict[str, ClassFigures] | None = None
              ) -> dict[str, ClassFigures]:
    """Add one replica's latency-target series to `into` (tier -> figures); other lines, and
    malformed or non-finite values, are skipped."""
    figures = into if into is not None else {}
    for line in metrics_text.splitlines():
        if not line.startswith("aigw_replica_"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name = match["name"].removeprefix("aigw_replica_")
        kind = _HISTOGRAMS.get(name) or _COUNTERS.get(name) or _TARGETS.get(name)
        if kind is None:
            continue
        try:
            value = float(match["value"])
        except ValueError:
            continue
        if not math.isfinite(value):
            continue
        labels = dict(_LABEL.findall(match["labels"] or ""))
        tiers = [labels["service_tier"]] if "service_tier" in labels else list(TIERS)
        for tier in tiers:  # (the TPOT target has no class: it holds for each)
            if tier not in TIERS:
                continue
            entry = figures.setdefault(tier, ClassFigures())
            if name in _HISTOGRAMS:
                try:
                    upper = float(labels.get("le", "nan"))
                except ValueError:
                    continue
                histogram = entry.buckets[kind]
                if not math.isnan(upper) and (upper in histogram or len(histogram) < MAX_BUCKETS):
                    histogram[upper] = histogram.get(upper, 0.0) + value
            elif name in _COUNTERS:
                entry.counts[kind] = entry.counts.get(kind, 0.0) + value
            else:
                entry.targets_ms[kind] = value
    return figures


def bucket_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The q-quantile of a cumulative histogram (upper bound -> count), linear inside the
    bucket it falls in; the largest finite bound when it falls in +Inf; None with no samples."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    previous_bound, previous_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return previous_bound
            if count == previous_count:
                return bound
            return previous_bound + (bound - previous_bound) * (rank - previous_count) / (
                count - previous_count)
        previous_bound, previous_count = bound, count
    return previous_bound


class SloRates:
    """Per (model, tier) counters at the previous poll, for per-second rates (bounded by the
    configured models and the three classes)."""

    def __init__(self) -> None:
        self._previous: dict[tuple[str, str], tuple[float, dict[str, float]]] = {}

    def per_s(self, model: str, tier: str, now: float, counts: Mapping[str, float]
              ) -> dict[str, float | None]:
        last = self._previous.get((model, tier))
        self._previous[(model, tier)] = (now, dict(counts))
        if last is None or now <= last[0]:
            return {"goodput_per_s": None, "refused_per_s": None}
        elapsed_s = now - last[0]

        def rate(kind: str) -> float | None:
            delta = counts.get(kind, 0.0) - last[1].get(kind, 0.0)
            return delta / elapsed_s if delta >= 0 else None  # (a replica restarted)

        return {"goodput_per_s": rate("goodput"), "refused_per_s": rate("refused")}


def slo_rows(models: Iterable[tuple[str, float | None, float | None, list[str]]],
             rates: SloRates, now: float) -> list[dict[str, Any]]:
    """One row per (model, class) seen: `models` are (name, configured TTFT and TPOT targets,
    its replicas' /metrics texts)."""
    rows = []
    for name, ttft_target_ms, tpot_target_ms, texts in models:
        figures: dict[str, ClassFigures] = {}
        for text in texts:
            parse_slo(text, figures)
        for tier in TIERS:
            entry = figures.get(tier)
            if entry is None or not (entry.counts or any(entry.buckets.values())):
                continue
            completed = entry.counts.get("completed", 0.0)
            goodput = entry.counts.get("goodput", 0.0)
            ttft_target = entry.targets_ms.get("ttft_target_ms", ttft_target_ms)
            tpot_target = entry.targets_ms.get("tpot_target_ms", tpot_target_ms)
            ttft_p90 = bucket_quantile(0.9, entry.buckets["ttft"])
            tpot_p90 = bucket_quantile(0.9, entry.buckets["tpot"])
            rows.append({
                "model": name, "service_tier": tier,
                "ttft_p90_s": ttft_p90, "ttft_target_ms": ttft_target,
                "ttft_within": _within(ttft_p90, ttft_target),
                "tpot_p90_s": tpot_p90, "tpot_target_ms": tpot_target,
                "tpot_within": _within(tpot_p90, tpot_target),
                "completed": completed, "goodput": goodput,
                "goodput_ratio": goodput / completed if completed else None,
                "refused": entry.counts.get("refused", 0.0),
                **rates.per_s(name, tier, now, entry.counts)})
    return rows


def _within(p90_s: float | None, target_ms: float | None) -> bool | None:
    if p90_s is None or not target_ms:
        return None
    return p90_s * 1000.0 <= target_ms
