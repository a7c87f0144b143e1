"""USD budgets over windows: a UTC day, a UTC calendar month, or a custom fixed window.

    budget = Budget(usd=100, window="month", alert_at=[0.5, 0.9])
    window = budget.window_at(time.time())   # Window(key="2026-12", start_s, end_s)

A custom window is `window_s` seconds long, the k-th starting at `starts_at + k * window_s`
(`starts_at` defaults to the unix epoch, so a 3,600 s window is a UTC hour). A window's `key`
names its spend counter: the day ("2026-12-02"), the month ("2026-12"), or
"c<window_s>@<starts_at>:<k>"; so changing a budget's amount keeps what its window has spent, and
each scope has at most one budget per window kind (a second one would share its counter).

`alert_at` are soft thresholds (fractions of `usd`, at most `MAX_ALERTS`): each fires the scope's
webhook once per window when the spend reaches it (gateway/metering/alerts.py). They refuse nothing.
"""

from __future__ import annotations

import calendar
import math
import time
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_ALERTS = 4
MIN_CUSTOM_WINDOW_S = 60
MAX_CUSTOM_WINDOW_S = 366 * 86_400
DAY_S = 86_400
NANOS_PER_USD = 1_000_000_000  # as gateway/metering/prices.py counts


@dataclass(frozen=True)
class Window:
    key: str  # names the spend counter of this window (see the module docstring)
    start_s: float  # unix seconds, inclusive
    end_s: float  # unix seconds, exclusive

    def reset_s(self, now: float) -> float:
        return max(self.end_s - now, 0.0)


class Budget(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    usd: float = Field(gt=0, le=1e9)
    window: Literal["day", "month", "custom"] = "day"
    window_s: int | None = Field(default=None, ge=MIN_CUSTOM_WINDOW_S, le=MAX_CUSTOM_WINDOW_S)
    starts_at: float = Field(default=0.0, ge=0, le=1e11)
    alert_at: tuple[float, ...] = Field(default=(), max_length=MAX_ALERTS)

    @model_validator(mode="after")
    def _check(self) -> Budget:
        if (self.window == "custom") != (self.window_s is not None):
            raise ValueError("window_s is required for a custom window, and only for one")
        if self.window != "custom" and self.starts_at:
            raise ValueError("starts_at applies to a custom window only")
        for fraction in self.alert_at:
            if not (0 < fraction <= 1):
                raise ValueError("alert_at holds fractions of the budget in (0, 1]")
        if len(set(self.alert_at)) != len(self.alert_at):
            raise ValueError("alert_at repeats a threshold")
        return self

    @property
    def nanos(self) -> int:
        return round(self.usd * NANOS_PER_USD)

    @property
    def kind(self) -> str:
        """What two budgets of one scope may not share: "day", "month" or the custom window."""
        return self.window if self.window != "custom" else f"c{self.window_s}@{self.starts_at:g}"

    def window_at(self, now: float) -> Window:
        if self.window == "day":
            start = now - now % DAY_S
            return Window(time.strftime("%Y-%m-%d", time.gmtime(now)), start, start + DAY_S)
        if self.window == "month":
            year, month = time.gmtime(now)[:2]
            start = calendar.timegm((year, month, 1, 0, 0, 0))
            next_year, next_month = (year + 1, 1) if month == 12 else (year, month + 1)
            return Window(f"{year:04d}-{month:02d}", float(start),
                          float(calendar.timegm((next_year, next_month, 1, 0, 0, 0))))
        assert self.window_s is not None
        index = math.floor((now - self.starts_at) / self.window_s)
        start = self.starts_at + index * self.window_s
        return Window(f"{self.kind}:{index}", start, start + self.window_s)

    def describe(self) -> str:
        if self.window == "custom":
            return f"budget of {self.window_s} s"
        return "daily budget" if self.window == "day" else "monthly budget"
