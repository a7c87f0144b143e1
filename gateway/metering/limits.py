"""Rate limits and budgets: the admission rule, the 429 headers, and the in-process limiter.

Counters per scope (the project, and each key):
    requests    per minute window (unix_s // 60)    +1 at admit
    tokens      per minute window                   +reserved at admit, +(actual - reserved) at
                                                    settle
    concurrent  requests admitted and not settled   +1 at admit, -1 at settle (Redis: a sorted set
                                                    of request ids with a lease, so a gateway that
                                                    dies mid-request frees its slots after it)
    spent       per budget window, nano-USD         +reserved cost at admit, +(actual - reserved)
                                                    at settle (budgets.py: day, month, custom)

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
from functools import cached_property

from gateway.metering.budgets import Budget, Window
from gateway.metering.contract import Admission, RateLimited
from gateway.metering.settings import Limits

WINDOW_S = 60
# a concurrency slot of a request whose settle never came (its gateway died) frees after this
CONCURRENCY_LEASE_S = 600


@dataclass(frozen=True)
class Counts:
    num_requests: int = 0
    num_tokens: int = 0
    spent_nanos: tuple[int, ...] = ()  # per budget of the scope, in ScopeLimits.budgets order
    num_concurrent: int = 0


@dataclass(frozen=True)
class ScopeLimits:
    """The limits of one scope of `project`: `name` is "proj" or "key:<key_id>"."""

    project: str
    name: str
    limits: Limits

    @property
    def qualified_name(self) -> tuple[str, str]:
        return (self.project, self.name)

    @cached_property
    def budgets(self) -> tuple[Budget, ...]:
        return self.limits.all_budgets

    @property
    def is_project(self) -> bool:
        return self.name == "proj"

    @property
    def key_id(self) -> str | None:
        return None if self.is_project else self.name.removeprefix("key:")

    def windows_at(self, now: float) -> tuple[Window, ...]:
        return tuple(b.window_at(now) for b in self.budgets)


@dataclass
class MeterAdmission(Admission):
    """What settle needs to replace the reservation: the windows it was counted in."""

    minute_window: int = 0
    reserved_nanos: int = 0
    scopes: tuple[str, ...] = ()  # names of the scopes whose counters hold the reservation
    # per scope of `scopes`: the budget windows its spend was reserved in
    windows: tuple[tuple[Window, ...], ...] = ()
    concurrent_scopes: tuple[str, ...] = ()  # the scopes that counted it as in flight
    scope_limits: tuple[ScopeLimits, ...] = ()  # as admitted: settle checks their alert_at

    @property
    def counts_against_limits(self) -> bool:
        return bool(self.scopes)


@dataclass(frozen=True)
class Spend:
    """A budget window's spend after a settle (what the alerts check)."""

    scope: ScopeLimits
    budget: Budget
    window: Window
    spent_nanos: int


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


def denied_limit(scope: ScopeLimits, before: Counts, num_tokens: int,
                 nanos: int) -> tuple[str, int] | None:
    """Which limit refuses this reservation ("requests", "tokens", "concurrency", or "budget"
    with the budget's index), or None."""
    limits = scope.limits
    rpm, tpm, conc = (limits.requests_per_minute, limits.tokens_per_minute,
                      limits.max_concurrent_requests)
    if rpm is not None and before.num_requests >= rpm:
        return ("requests", 0)
    if tpm is not None and (before.num_tokens >= tpm
                            or (before.num_tokens > 0 and before.num_tokens + num_tokens > tpm)):
        return ("tokens", 0)
    if conc is not None and before.num_concurrent >= conc:
        return ("concurrency", 0)
    for index, (budget, spent) in enumerate(zip(scope.budgets, before.spent_nanos, strict=True)):
        limit = budget.nanos
        if spent >= limit or (spent > 0 and spent + nanos > limit):
            return ("budget", index)
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


def rate_limited(scope: ScopeLimits, denied: tuple[str, int],
                 scopes: list[tuple[ScopeLimits, Counts]], clock: Clock) -> RateLimited:
    what, index = denied
    who = "project" if scope.is_project else "key"
    if what == "budget":
        budget = scope.budgets[index]
        retry_after_s = budget.window_at(clock.now).reset_s(clock.now)
        message = f"{budget.describe()} of this {who} is spent"
    elif what == "concurrency":
        retry_after_s = 1.0
        message = f"concurrent requests limit of this {who} reached"
    else:
        retry_after_s = clock.window_reset_s
        message = f"{what} per minute limit of this {who} reached"
    headers = rate_headers(scopes, clock)
    headers["retry-after"] = str(max(1, math.ceil(retry_after_s)))
    return RateLimited(message, retry_after_s, headers)


class LocalLimiter:
    """Counters in this process (the embedded store): check-and-reserve under one lock.

    A window's spend starts from what the usage table already holds (`seed_spent`), so a restart
    does not reset a budget; windows that have ended are dropped once a minute.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._window = 0
        # (project, scope name) -> [requests, tokens] in self._window
        self._minute: dict[tuple[str, str], list[int]] = {}
        # (project, scope name, window key) -> [nano-USD, window end (unix s)]
        self._spent: dict[tuple[str, str, str], list[float]] = {}
        self._concurrent: dict[tuple[str, str], int] = {}

    def has_spent(self, scope: ScopeLimits, window: Window) -> bool:
        return (*scope.qualified_name, window.key) in self._spent

    def seed_spent(self, scope: ScopeLimits, window: Window, spent_nanos: int) -> None:
        with self._lock:
            self._spent.setdefault((*scope.qualified_name, window.key), [spent_nanos, window.end_s])

    def admit(self, admission: MeterAdmission, scopes: list[ScopeLimits], clock: Clock
              ) -> tuple[list[tuple[ScopeLimits, Counts]], RateLimited | None]:
        """Reserve in every scope or in none; returns the counts after and the refusal, if any."""
        num_tokens, nanos = admission.reserved_tokens, admission.reserved_nanos
        with self._lock:
            if clock.minute_window != self._window:
                self._window, self._minute = clock.minute_window, {}
                self._spent = {k: v for k, v in self._spent.items() if v[1] > clock.now}
            before = []
            windows = tuple(s.windows_at(clock.now) for s in scopes)
            for s, scope_windows in zip(scopes, windows, strict=True):
                used_requests, used_tokens = self._minute.get(s.qualified_name, (0, 0))
                spent_nanos = tuple(int(self._spent.get((*s.qualified_name, w.key), (0, 0))[0])
                                    for w in scope_windows)
                before.append((s, Counts(used_requests, used_tokens, spent_nanos,
                                         self._concurrent.get(s.qualified_name, 0))))
            for scope, counts in before:
                denied = denied_limit(scope, counts, num_tokens, nanos)
                if denied is not None:
                    return before, rate_limited(scope, denied, before, clock)
            after = []
            for (scope, counts), scope_windows in zip(before, windows, strict=True):
                name = scope.qualified_name
                self._minute[name] = [counts.num_requests + 1, counts.num_tokens + num_tokens]
                for window, window_spent in zip(scope_windows, counts.spent_nanos, strict=True):
                    self._spent[(*name, window.key)] = [window_spent + nanos, window.end_s]
                concurrent = counts.num_concurrent
                if scope.limits.max_concurrent_requests is not None:
                    concurrent = self._concurrent[name] = concurrent + 1
                after.append((scope, Counts(counts.num_requests + 1, counts.num_tokens + num_tokens,
                                            tuple(s + nanos for s in counts.spent_nanos),
                                            concurrent)))
            admission.windows = windows
            admission.concurrent_scopes = tuple(
                s.name for s in scopes if s.limits.max_concurrent_requests is not None)
            return after, None

    def release(self, admission: MeterAdmission) -> None:
        """The request is over: its concurrency slots are free (once per admission)."""
        project = admission.principal.project
        with self._lock:
            for name in admission.concurrent_scopes:
                left = self._concurrent.get((project, name), 0) - 1
                if left > 0:
                    self._concurrent[(project, name)] = left
                else:
                    self._concurrent.pop((project, name), None)
        admission.concurrent_scopes = ()

    def settle(self, admission: MeterAdmission, delta_tokens: int, delta_nanos: int) -> list[Spend]:
        """Replace the reservation by the actual; returns the budgets' spend after it."""
        project = admission.principal.project
        spends = []
        with self._lock:
            for name, scope, windows in zip(admission.scopes, admission.scope_limits,
                                            admission.windows, strict=True):
                if admission.minute_window == self._window and (project, name) in self._minute:
                    self._minute[(project, name)][1] += delta_tokens
                for budget, window in zip(scope.budgets, windows, strict=True):
                    entry = self._spent.get((project, name, window.key))
                    if entry is not None:
                        entry[0] += delta_nanos
                        spends.append(Spend(scope, budget, window, int(entry[0])))
        return spends
