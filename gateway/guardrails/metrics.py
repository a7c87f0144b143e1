"""/metrics families of the guardrails (read at scrape time; each worker's own counts).

    aigw_guardrail_blocks_total{guardrail,stage}     requests or answers refused (stage: request |
                                                     response)
    aigw_guardrail_rewrites_total{guardrail}         requests whose text a guard masked
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric

from gateway.guardrails.chain import Guardrails


class GuardrailCollector:
    """`guardrails` is set by the app when any is configured (until then: no samples)."""

    def __init__(self, guardrails: Guardrails | None = None) -> None:
        self.guardrails = guardrails

    def collect(self) -> Iterator[Metric]:
        blocked = self.guardrails.num_blocked if self.guardrails is not None else {}
        rewritten = self.guardrails.num_rewritten if self.guardrails is not None else {}
        blocks = CounterMetricFamily("aigw_guardrail_blocks", "Requests or answers a guardrail "
                                     "refused.", labels=["guardrail", "stage"])
        for (name, stage), count in sorted(blocked.items()):
            blocks.add_metric([name, stage], count)
        rewrites = CounterMetricFamily("aigw_guardrail_rewrites", "Requests whose text a "
                                       "guardrail rewrote (masked).", labels=["guardrail"])
        for name, count in sorted(rewritten.items()):
            rewrites.add_metric([name], count)
        yield from (blocks, rewrites)
