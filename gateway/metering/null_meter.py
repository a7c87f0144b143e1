"""Metering turned OFF: nothing is counted (auth off is auth/authenticator.py's
AnonymousAuthenticator: every caller is the one anonymous principal, auth/principal.py ANONYMOUS).

Used when `settings.auth_enabled` is false (`aigw serve --no-auth`, unit tests, the benchmark's
"auth off" row). Never the default of a served gateway.
"""

from __future__ import annotations

from auth.principal import Principal
from gateway.metering.contract import Admission, UsageRecord


class NullMeter:
    """Admits everything; `settled` keeps the last records by request id (bounded), and
    `num_settle_calls` counts every settle call (tests check it is one per request)."""

    def __init__(self, num_records_kept: int = 1000) -> None:
        self.settled: dict[str, UsageRecord] = {}
        self._num_records_kept = num_records_kept
        self.num_settle_calls = 0

    async def admit(self, request_id: str, principal: Principal, model: str,
                    num_prompt_tokens: int, max_tokens: int) -> Admission:
        return Admission(request_id, principal, model, num_prompt_tokens + max_tokens)

    async def settle(self, admission: Admission, record: UsageRecord) -> None:
        self.settle_nowait(admission, record)

    def settle_nowait(self, admission: Admission, record: UsageRecord) -> None:
        self.num_settle_calls += 1
        if len(self.settled) >= self._num_records_kept:
            self.settled.pop(next(iter(self.settled)))
        self.settled[record.request_id] = record
