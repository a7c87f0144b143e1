"""A retry budget: retries may add at most `ratio` extra load, plus a small reserve.

Every request deposits `ratio` tokens (up to `ratio * 100 + reserve`), every retry withdraws one.
This keeps a failing fleet from being hit by `1 + num_retries` times its normal load.
"""

from __future__ import annotations


class RetryBudget:
    def __init__(self, ratio: float, num_reserve: int) -> None:
        if ratio < 0 or num_reserve < 0:
            raise ValueError("ratio and num_reserve must not be negative")
        self._capacity = ratio * 100 + num_reserve
        self._ratio = ratio
        self._balance = float(num_reserve)

    def on_request(self) -> None:
        self._balance = min(self._capacity, self._balance + self._ratio)

    def try_withdraw(self) -> bool:
        """Spend one retry if the budget allows it."""
        if self._balance >= 1.0:
            self._balance -= 1.0
            return True
        return False
