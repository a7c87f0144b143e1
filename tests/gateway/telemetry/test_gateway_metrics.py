"""GatewayMetrics on its own: what a scrape derives from the counters."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gateway.metering.contract import UsageRecord
from gateway.telemetry.metrics import GatewayMetrics


def _record(project: str, model: str, prompt_tokens: int, cached_tokens: int) -> UsageRecord:
    return UsageRecord(request_id=f"{project}-{model}-{prompt_tokens}", project=project, key_id="k",
                       model=model, endpoint="e", prompt_tokens=prompt_tokens,
                       cached_tokens=cached_tokens, completion_tokens=3, cost_usd=0.0,
                       latency_ms=1.0, status=200, created_at=0.0, stream=False,
                       finish_reason="stop")


def test_the_cache_hit_ratio_is_cached_over_input_tokens_of_all_a_projects_models() -> None:
    metrics = GatewayMetrics()
    for record in (_record("a", "m1", 100, 50), _record("a", "m2", 300, 0),
                   _record("b", "m1", 10, 10), _record("c", "m1", 0, 0)):
        metrics.observe_usage(record)
    ratios = {sample.labels["project"]: sample.value
              for family in text_string_to_metric_families(metrics.render().decode())
              if family.name == "aigw_prompt_cache_hit_ratio" for sample in family.samples}
    assert ratios == {"a": 0.125, "b": 1.0}  # c has no prompt tokens yet: no ratio
