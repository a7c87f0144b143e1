"""Rate limits and budgets: the admission rule, the 429 headers, and the in-process limiter.

Counters per scope (the project, and each key), per window:
    requests  per minute window (unix_s // 60)     +1 at admit
    tokens    per minute window                    +reserved at admit, +(actual - reserved) at settle
    spent     per UTC day, nano-USD                +reserved cost at admit, +(actual - reserved) at settle

The rule (`denied_limit`, mirrored by the Lua script in redis_meter.py): a request is refused when a
counter is already at its limit, or when its reservation would pass the limit *and* something is
already counted. So one request larger than a whole limit can run alone, and the limit is passed
by at most that one request, however many callers race (the check-and-reserve is atomic).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

from gateway.metering.contract import Admission, RateLimited
from gateway.metering.prices import NANOS_PER_USD
from gateway.metering.settings import Limits

WINDOW_S = 60


@dataclass(frozen=True)
class Counts:
    num_requests: int = 0
    num_tokens: int = 0
    spent_nanos: int = 0


@dataclass(frozen=True)
class ScopeLimits:
    """The limits of one scope of `project`: `name` is "proj" or "key:<key_id>"."""

    project: str
    name: str
    limits: Limits

    @property
    def qualified_name(self) -> tuple[str, str]:
        return (self.project, self.name)

    @property
    def budget_nanos(self) -> int | None:
        budget = self.limits.daily_budget_usd
        return None if budget is None else round(budget * NANOS_PER_USD)


@dataclass
class MeterAdmission(Admission):
    """What settle needs to replace the reservation: the windows it was counted in."""

    minute_window: int = 0
    day: str = ""
    reserved_nanos: int = 0
    scopes: tuple[str, ...] = ()  # names of the scopes whose counters hold the reservation

    @property
    def counts_against_limits(self) -> bool:
        return bool(self.scopes)


@dataclass
class Clock:
    now: float = field(default_factory=time.time)

    @property
    def minute_window(self) -> int:
        return int(self.now // WINDOW_S)

    @property
    def window_reset_s(self) -> float:
        return WINDOW_S - self.now % WINDOW_S

    @property
    def day(self) -> str:
        return time.strftime("%Y-%m-%d", time.gmtime(self.now))

    @property
    def day_reset_s(self) -> float:
        return 86_400 - self.now % 86_400


def denied_limit(scope: ScopeLimits, before: Counts, num_tokens: int, nanos: int) -> str | None:
    """Which limit refuses this reservation ("requests", "tokens", "budget"), or None."""
    rpm, tpm, budget = (scope.limits.requests_per_minute, scope.limits.tokens_per_minute,
                        scope.budget_nanos)
    if rpm is not None and before.num_requests >= rpm:
        return "requests"
    if tpm is not None and (before.num_tokens >= tpm
                            or (before.num_tokens > 0 and before.num_tokens + num_tokens > tpm)):
        return "tokens"
    if budget is not None and (before.spent_nanos >= budget
                               or (before.spent_nanos > 0 and before.spent_nanos + nanos > budget)):
        return "budget"
    return None


def rate_headers(scopes: list[tuple[ScopeLimits, Counts]], clock: Clock) -> dict[str, str]:
    """x-ratelimit-* from the tightest scope of each kind (counts taken after the admission)."""
    headers: dict[str, str] = {}
    reset = f"{math.ceil(clock.window_reset_s)}s"
    for kind in ("requests", "tokens"):
        tightest: tuple[int, int] | None = None
        for scope, counts in scopes:
            if kind == "requests":
                limit, used = scope.limits.requests_per_minute, counts.num_requests
            else:
                limit, used = scope.limits.tokens_per_minute, counts.num_tokens
            if limit is None:
                continue
            remaining = max(limit - used, 0)
            if tightest is None or remaining < tightest[1]:
                tightest = (limit, remaining)
        if tightest is not None:
            headers[f"x-ratelimit-limit-{kind}"] = str(tightest[0])
            headers[f"x-ratelimit-remaining-{kind}"] = str(tightest[1])
            headers[f"x-ratelimit-reset-{kind}"] = reset
    return headers


def rate_limited(scope: ScopeLimits, what: str, scopes: list[tuple[ScopeLimits, Counts]],
                 clock: Clock) -> RateLimited:
    retry_after_s = clock.day_reset_s if what == "budget" else clock.window_reset_s
    headers = rate_headers(scopes, clock)
    headers["retry-after"] = str(max(1, math.ceil(retry_after_s)))
    who = "project" if scope.name == "proj" else "key"
    message = (f"daily budget of this {who} is spent" if what == "budget"
               else f"{what} per minute limit of this {who} reached")
    return RateLimited(message, retry_after_s, headers)


class LocalLimiter:
    """Counters in this process (the embedded store): check-and-reserve under one lock.

    `spent` of a day starts from what the usage table already holds (`seed_spent`), so a restart
    does not reset a budget.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._window = 0
        # (project, scope name) -> [requests, tokens] in self._window
        self._minute: dict[tuple[str, str], list[int]] = {}
        self._spent: dict[tuple[str, str, str], int] = {}  # (project, scope name, day) -> nano-USD

    def has_spent(self, scope: ScopeLimits, day: str) -> bool:
        return (*scope.qualified_name, day) in self._spent

    def seed_spent(self, scope: ScopeLimits, day: str, spent_nanos: int) -> None:
        with self._lock:
            self._spent.setdefault((*scope.qualified_name, day), spent_nanos)

    def admit(self, scopes: list[ScopeLimits], clock: Clock, num_tokens: int,
              nanos: int) -> tuple[list[tuple[ScopeLimits, Counts]], RateLimited | None]:
        """Reserve in every scope or in none; returns the counts after and the refusal, if any."""
        with self._lock:
            if clock.minute_window != self._window:
                self._window, self._minute = clock.minute_window, {}
            before = []
            for s in scopes:
                used_requests, used_tokens = self._minute.get(s.qualified_name, (0, 0))
                before.append((s, Counts(used_requests, used_tokens,
                                         self._spent.get((*s.qualified_name, clock.day), 0))))
            for scope, counts in before:
                what = denied_limit(scope, counts, num_tokens, nanos)
                if what is not None:
                    return before, rate_limited(scope, what, before, clock)
            after = []
            for scope, counts in before:
                self._minute[scope.qualified_name] = [counts.num_requests + 1,
                                                      counts.num_tokens + num_tokens]
                self._spent[(*scope.qualified_name, clock.day)] = counts.spent_nanos + nanos
                after.append((scope, Counts(counts.num_requests + 1, counts.num_tokens + num_tokens,
                                            counts.spent_nanos + nanos)))
            return after, None

    def settle(self, admission: MeterAdmission, delta_tokens: int, delta_nanos: int) -> None:
        project = admission.principal.project
        with self._lock:
            for name in admission.scopes:
                if admission.minute_window == self._window and (project, name) in self._minute:
                    self._minute[(project, name)][1] += delta_tokens
                if (project, name, admission.day) in self._spent:
                    self._spent[(project, name, admission.day)] += delta_nanos
