"""A circuit breaker per endpoint: passive outlier ejection on consecutive failures.

    CLOSED --(num_failures_to_eject consecutive failures)--> OPEN
    OPEN   --(ejection_s elapsed)--> HALF_OPEN: exactly one trial request is let through
    HALF_OPEN --success--> CLOSED      HALF_OPEN --failure--> OPEN (timer restarts)

Times are `time.monotonic()` seconds passed in by the caller, so tests need no clock.
"""

from __future__ import annotations

from enum import Enum


class BreakerState(Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(self, num_failures_to_eject: int, ejection_s: float) -> None:
        if num_failures_to_eject <= 0 or ejection_s <= 0:
            raise ValueError("num_failures_to_eject and ejection_s must be positive")
        self.num_failures_to_eject = num_failures_to_eject
        self.ejection_s = ejection_s
        self.state = BreakerState.CLOSED
        self.num_consecutive_failures = 0
        self._opened_at = 0.0
        self._trial_in_flight = False

    def can_attempt(self, now: float) -> bool:
        """May a request be sent now? (Pure: does not reserve the half-open trial.)"""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            return now - self._opened_at >= self.ejection_s
        return not self._trial_in_flight

    def on_attempt(self, now: float) -> None:
        """A request is being sent: an expired OPEN becomes HALF_OPEN with this as its trial."""
        if self.state is BreakerState.OPEN and now - self._opened_at >= self.ejection_s:
            self.state = BreakerState.HALF_OPEN
        if self.state is BreakerState.HALF_OPEN:
            self._trial_in_flight = True

    def record_success(self) -> None:
        self.state = BreakerState.CLOSED
        self.num_consecutive_failures = 0
        self._trial_in_flight = False

    def record_failure(self, now: float) -> None:
        self.num_consecutive_failures += 1
        self._trial_in_flight = False
        if (self.state is BreakerState.HALF_OPEN
                or self.num_consecutive_failures >= self.num_failures_to_eject):
            self.state = BreakerState.OPEN
            self._opened_at = now
