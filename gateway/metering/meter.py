"""The shared half of both meters: which limits apply, what to reserve, and the read side.

    admit   reserve prompt + max_tokens tokens (and their worst-case cost) in the project's and
            the key's counters, or raise RateLimited; no counters when no limit applies
    settle  record the usage once per request id (idempotent) and, only for the first call,
            replace the reservation with the actual tokens and cost
    settle_nowait  the same, queued: returns at once (the gateway's answer never waits for the
            usage write); a failed write is logged. Reads (usage, a budget's spend) first wait
            for queued writes, so they see every record settled before them.

The backends (redis_meter.RedisMeter, embedded_meter.EmbeddedMeter) implement `_reserve`,
`_record` and the reads. `record.cost_usd` is what the client was shown (the gateway computes it
with `cost_usd`), and is what usage and budgets count.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence

from auth.principal import Principal
from gateway.metering.alerts import BudgetAlerts
from gateway.metering.contract import (
    Admission,
    MeterBacklogged,
    ReservationTooLarge,
    UsageRecord,
)
from gateway.metering.limit_store import StoredLimits
from gateway.metering.limits import Clock, MeterAdmission, ScopeLimits, Spend
from gateway.metering.prices import NANOS_PER_USD, cost_nanos, cost_usd, price_for
from gateway.metering.settings import Limits, MeteringSettings, ModelPrice
from gateway.metering.usage_report import (
    DAILY_FIELDS,
    UsageRow,
    group_records,
    group_rows,
    validate_group_by,
)

log = logging.getLogger("aigw.metering")
# a queued settle waits up to this long for others to share its store round trip (Coalescer)
SETTLE_LINGER_S = 0.01
_NUM_CACHED_SCOPES = 100_000
# One reservation at most: far above any model's context (2**40 tokens), and small enough that
# the counters (Redis INCRBY and SQLite: signed 64 bits; Lua reads them as doubles, exact to
# 2**53) never overflow however many such reservations a window holds before a limit refuses.
MAX_RESERVED_TOKENS = 2**40
MAX_RESERVED_NANOS = 2**52


class BaseMeter(ABC):
    def __init__(self, settings: MeteringSettings) -> None:
        self.settings = settings
        self._scopes: dict[tuple[str, str], list[ScopeLimits]] = {}
        self._stored = StoredLimits()  # set through the admin API: replace the settings' per scope
        self._alerts: BudgetAlerts | None = None  # started by the first threshold crossed

    def set_stored_limits(self, stored: StoredLimits) -> None:
        """The limits set through the admin API (gateway/metering/limit_store.py), as loaded by
        its watcher: from the next admission on, they replace the settings' for their scopes."""
        self._stored = stored
        self._scopes = {}

    @property
    def stored_limits(self) -> StoredLimits:
        return self._stored

    def limits_for_project(self, project: str) -> Limits:
        stored = self._stored.projects.get(project)
        return stored if stored is not None else self.settings.limits_for_project(project)

    def limits_for_key(self, key_id: str) -> Limits:
        stored = self._stored.keys.get(key_id)
        return stored if stored is not None else self.settings.limits_for_key(key_id)

    def price_for(self, model: str) -> ModelPrice | None:
        return price_for(self.settings, model)

    def cost_usd(self, model: str, prompt_tokens: int, cached_tokens: int,
                 completion_tokens: int) -> float:
        return cost_usd(self.settings, model, prompt_tokens, cached_tokens, completion_tokens)

    def scopes_for(self, principal: Principal) -> list[ScopeLimits]:
        """The scopes with a limit (cached per caller until the stored limits change)."""
        cache_key = (principal.project, principal.key_id)
        scopes = self._scopes.get(cache_key)
        if scopes is None:
            project = principal.project
            every = [ScopeLimits(project, "proj", self.limits_for_project(project)),
                     ScopeLimits(project, f"key:{principal.key_id}",
                                 self.limits_for_key(principal.key_id))]
            if len(self._scopes) >= _NUM_CACHED_SCOPES:
                self._scopes.clear()
            scopes = self._scopes[cache_key] = [s for s in every if s.limits.any]
        return scopes

    def counts_tokens(self, principal: Principal) -> bool:
        """True when a tokens-per-minute limit or a budget applies to this caller: then the
        admission's prompt count decides how far a limit can be overshot, and the gateway counts
        the rendered prompt exactly where it can."""
        for scope in self.scopes_for(principal):  # (a loop: any() of a generator is 2 calls)
            if scope.limits.tokens_per_minute is not None or scope.budgets:
                return True
        return False

    def backlog_bytes(self) -> int:
        """Bytes of usage writes not yet in the store (queued, in flight, held)."""
        return 0

    def _observe_spends(self, spends: list[Spend]) -> None:
        """After a settle: fire the alerts whose threshold a budget window's spend reached."""
        if not spends or not any(s.budget.alert_at for s in spends):
            return
        if self._alerts is None:
            self._alerts = BudgetAlerts(self._claim_alert)
        self._alerts.observe(spends)

    async def _claim_alert(self, spend: Spend, threshold: float) -> bool:
        """True for the one caller (of every gateway on the store) that may send this alert of
        this window; the backends claim it in their store."""
        return True

    async def _close_alerts(self) -> None:
        if self._alerts is not None:
            await self._alerts.close()

    async def admit(self, request_id: str, principal: Principal, model: str,
                    num_prompt_tokens: int, max_tokens: int) -> MeterAdmission:
        """Reserve, or raise RateLimited (429 with its headers), or ReservationTooLarge (400)
        for a worst case beyond what the counters hold (checked before anything is counted),
        or MeterBacklogged (503) while the usage writes waiting on the store are over
        `backlog_max_bytes` (back-pressure: every admitted request adds one write, so refusing
        new ones bounds the backlog by the bound plus the requests already in flight, and no
        record is ever dropped)."""
        backlog = self.backlog_bytes()
        if backlog > self.settings.backlog_max_bytes:
            raise MeterBacklogged(
                f"usage writes are not reaching the store ({backlog} bytes waiting); retry shortly")
        num_tokens = num_prompt_tokens + max_tokens
        scopes = self.scopes_for(principal)
        if not scopes:
            return MeterAdmission(request_id, principal, model, num_tokens)
        if num_tokens > MAX_RESERVED_TOKENS:
            raise ReservationTooLarge(f"prompt + max_tokens ({num_tokens}) is over "
                                      f"{MAX_RESERVED_TOKENS} tokens")
        nanos = 0
        if any(s.budgets for s in scopes):
            nanos = cost_nanos(self.settings, model, num_prompt_tokens, 0, max_tokens)
            if nanos > MAX_RESERVED_NANOS:
                raise ReservationTooLarge(f"the worst-case cost of prompt + max_tokens "
                                          f"({nanos / NANOS_PER_USD:g} USD) is out of range")
        admission = MeterAdmission(request_id, principal, model, num_tokens,
                                   reserved_nanos=nanos, scopes=tuple(s.name for s in scopes),
                                   scope_limits=tuple(scopes))
        await self._reserve(admission, scopes, Clock())
        return admission

    async def settle(self, admission: Admission, record: UsageRecord) -> None:
        """Record once per record.request_id; later calls with the same id change nothing."""
        await self._record(*self._settlement(admission, record))

    def settle_nowait(self, admission: Admission, record: UsageRecord) -> None:
        """`settle`, queued (see the module docstring); never raises."""
        try:
            self._record_nowait(*self._settlement(admission, record))
        except Exception:  # noqa: BLE001 - metering must not fail the answer
            log.exception("settle failed for %s", record.request_id)

    def _settlement(self, admission: Admission, record: UsageRecord
                    ) -> tuple[MeterAdmission, UsageRecord, int, int, int]:
        """(admission, record, actual cost, token delta, cost delta) for `_record`."""
        if not isinstance(admission, MeterAdmission):  # made elsewhere: it reserved nothing
            admission = MeterAdmission(admission.request_id, admission.principal, admission.model,
                                       admission.reserved_tokens)
        actual_nanos = round(record.cost_usd * NANOS_PER_USD)
        # tokens per minute count what the upstream computed: cached prompt tokens are free
        delta_tokens = (record.prompt_tokens - record.cached_tokens + record.completion_tokens
                        - admission.reserved_tokens)
        delta_nanos = actual_nanos - admission.reserved_nanos
        return admission, record, actual_nanos, delta_tokens, delta_nanos

    async def usage_by_project(self, project: str, group_by: Sequence[str] = ("model", "day"),
                               since: str | None = None, until: str | None = None,
                               key_id: str | None = None, tag: str | None = None
                               ) -> list[UsageRow]:
        """Usage of `project` summed per group (usage_report.GROUP_FIELDS); since/until are
        inclusive UTC days (YYYY-MM-DD); `key_id` / `tag` keep that key's / tag's requests. By
        day and model from the per-day sums, else from the per-request records of the range."""
        fields = validate_group_by(group_by)
        if set(fields) <= DAILY_FIELDS and key_id is None and tag is None:
            return group_rows(await self._daily_rows(project, since, until), fields)
        records = [r for r in await self.usage_records(project, since, until)
                   if (key_id is None or r.key_id == key_id) and (tag is None or tag in r.tags)]
        return group_records(records, fields)

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
    def _record_nowait(self, admission: MeterAdmission, record: UsageRecord, cost_nanos: int,
                       delta_tokens: int, delta_nanos: int) -> None:
        """`_record`, queued; a failure is logged, not raised."""

    @abstractmethod
    async def _daily_rows(self, project: str, since: str | None,
                          until: str | None) -> list[UsageRow]: ...

    @abstractmethod
    async def close(self) -> None: ...


def usage_day(created_at: float) -> str:
    """The UTC day (YYYY-MM-DD) of a unix time; one strftime per day, not per record."""
    day_number = int(created_at // 86_400)
    day = _DAYS.get(day_number)
    if day is None:
        if len(_DAYS) > 64:
            _DAYS.clear()
        day = _DAYS[day_number] = Clock(day_number * 86_400.0).day
    return day


_DAYS: dict[int, str] = {}


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

    def _record_nowait(self, admission: MeterAdmission, record: UsageRecord, cost_nanos: int,
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
