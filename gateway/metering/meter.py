"""The shared half of both meters: which limits apply, what to reserve, and the read side.

    admit   reserve prompt + max_tokens tokens (and their worst-case cost) in the project's and
            the key's counters, or raise RateLimited; no counters when no limit applies
    settle  record the usage once per request id (idempotent) and, only for the first call,
            replace the reservation with the actual tokens and cost

The backends (redis_meter.RedisMeter, embedded_meter.EmbeddedMeter) implement `_reserve`,
`_record` and the reads. `record.cost_usd` is what the client was shown (the gateway computes it
with `cost_usd`), and is what usage and budgets count.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from auth.principal import Principal
from gateway.metering.contract import Admission, UsageRecord
from gateway.metering.limits import Clock, MeterAdmission, ScopeLimits
from gateway.metering.prices import NANOS_PER_USD, cost_nanos, cost_usd, price_for
from gateway.metering.settings import MeteringSettings, ModelPrice
from gateway.metering.usage_report import UsageRow, group_rows


class BaseMeter(ABC):
    def __init__(self, settings: MeteringSettings) -> None:
        self.settings = settings

    def price_for(self, model: str) -> ModelPrice | None:
        return price_for(self.settings, model)

    def cost_usd(self, model: str, prompt_tokens: int, cached_tokens: int,
                 completion_tokens: int) -> float:
        return cost_usd(self.settings, model, prompt_tokens, cached_tokens, completion_tokens)

    def scopes_for(self, principal: Principal) -> list[ScopeLimits]:
        project = principal.project
        scopes = [ScopeLimits(project, "proj", self.settings.limits_for_project(project)),
                  ScopeLimits(project, f"key:{principal.key_id}",
                              self.settings.limits_for_key(principal.key_id))]
        return [s for s in scopes if s.limits.any]

    async def admit(self, request_id: str, principal: Principal, model: str,
                    num_prompt_tokens: int, max_tokens: int) -> MeterAdmission:
        """Reserve, or raise RateLimited (429 with its headers)."""
        num_tokens = num_prompt_tokens + max_tokens
        scopes = self.scopes_for(principal)
        if not scopes:
            return MeterAdmission(request_id, principal, model, num_tokens)
        nanos = 0
        if any(s.limits.daily_budget_usd is not None for s in scopes):
            nanos = cost_nanos(self.settings, model, num_prompt_tokens, 0, max_tokens)
        admission = MeterAdmission(request_id, principal, model, num_tokens,
                                   reserved_nanos=nanos, scopes=tuple(s.name for s in scopes))
        await self._reserve(admission, scopes, Clock())
        return admission

    async def settle(self, admission: Admission, record: UsageRecord) -> None:
        """Record once per record.request_id; later calls with the same id change nothing."""
        if not isinstance(admission, MeterAdmission):  # made elsewhere: it reserved nothing
            admission = MeterAdmission(admission.request_id, admission.principal, admission.model,
                                       admission.reserved_tokens)
        actual_nanos = round(record.cost_usd * NANOS_PER_USD)
        delta_tokens = record.prompt_tokens + record.completion_tokens - admission.reserved_tokens
        delta_nanos = actual_nanos - admission.reserved_nanos
        await self._record(admission, record, actual_nanos, delta_tokens, delta_nanos)

    async def usage_by_project(self, project: str, group_by: Sequence[str] = ("model", "day"),
                               since: str | None = None, until: str | None = None) -> list[UsageRow]:
        """Usage of `project` summed per group; since/until are inclusive UTC days (YYYY-MM-DD)."""
        return group_rows(await self._daily_rows(project, since, until), group_by)

    @abstractmethod
    async def usage_records(self, project: str, since: str | None = None,
                            until: str | None = None) -> list[UsageRecord]:
        """The per-request records of `project`, oldest first."""

    @abstractmethod
    async def _reserve(self, admission: MeterAdmission, scopes: list[ScopeLimits],
                       clock: Clock) -> None:
        """Atomically check every scope and reserve in all of them (filling admission.headers,
        minute_window and day), or raise RateLimited having reserved nothing."""

    @abstractmethod
    async def _record(self, admission: MeterAdmission, record: UsageRecord, cost_nanos: int,
                      delta_tokens: int, delta_nanos: int) -> None: ...

    @abstractmethod
    async def _daily_rows(self, project: str, since: str | None,
                          until: str | None) -> list[UsageRow]: ...

    @abstractmethod
    async def close(self) -> None: ...


def usage_day(created_at: float) -> str:
    return Clock(created_at).day


class DisabledMeter(BaseMeter):
    """MeteringSettings.enabled=False: admits everything, records nothing, reads back nothing."""

    async def _reserve(self, admission: MeterAdmission, scopes: list[ScopeLimits],
                       clock: Clock) -> None:
        return None

    def scopes_for(self, principal: Principal) -> list[ScopeLimits]:
        return []

    async def _record(self, admission: MeterAdmission, record: UsageRecord, cost_nanos: int,
                      delta_tokens: int, delta_nanos: int) -> None:
        return None

    async def _daily_rows(self, project: str, since: str | None,
                          until: str | None) -> list[UsageRow]:
        return []

    async def usage_records(self, project: str, since: str | None = None,
                            until: str | None = None) -> list[UsageRecord]:
        return []

    async def close(self) -> None:
        return None
