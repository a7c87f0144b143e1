"""The metering contract: the usage record, and the two calls the gateway makes per request.

    # may raise RateLimited:
    admission = await meter.admit(principal, model, num_prompt_tokens, max_tokens)
    ... dispatch, stream ...
    await meter.settle(admission, record)  # exactly once per request id, even on disconnect/failure

`settle` is idempotent on `record.request_id`: calling it twice never counts twice. A meter may
also offer `settle_nowait(admission, record)` (synchronous, never raises: the write is queued);
the pipeline then settles without the answer waiting for the store, except for admissions that
`counts_against_limits`: those settle before the answer is sent (a limit must hold for a client
that sends its requests one after another, alternating gateways).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from auth.principal import Principal


@dataclass(frozen=True, init=False)
class UsageRecord:
    request_id: str
    project: str
    key_id: str
    model: str
    endpoint: str  # the replica/upstream that served it ("" if none did)
    prompt_tokens: int
    cached_tokens: int  # part of prompt_tokens that hit the prompt cache
    completion_tokens: int
    cost_usd: float
    latency_ms: float
    status: int  # HTTP status the client got (200 also for a stream that ended in an error event)
    created_at: float  # unix seconds
    stream: bool = False
    finish_reason: str | None = None
    # part of completion_tokens a reasoning model spent reasoning (billed as completion, as
    # OpenAI bills it); last and defaulted, so records written before it read back as 0
    reasoning_tokens: int = 0
    # the request's usage tags and session (gateway/request/usage_tags.py: bounded in bytes)
    tags: tuple[str, ...] = ()
    session_id: str | None = None

    def __init__(self, request_id: str, project: str, key_id: str, model: str, endpoint: str,
                 prompt_tokens: int, cached_tokens: int, completion_tokens: int, cost_usd: float,
                 latency_ms: float, status: int, created_at: float, stream: bool = False,
                 finish_reason: str | None = None, reasoning_tokens: int = 0,
                 tags: tuple[str, ...] | list[str] = (), session_id: str | None = None) -> None:
        """The dataclass's own init, in one write (a frozen one sets each field by a call)."""
        self.__dict__.update(
            request_id=request_id, project=project, key_id=key_id, model=model, endpoint=endpoint,
            prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
            completion_tokens=completion_tokens, cost_usd=cost_usd, latency_ms=latency_ms,
            status=status, created_at=created_at, stream=stream, finish_reason=finish_reason,
            reasoning_tokens=reasoning_tokens, tags=tuple(tags), session_id=session_id)


class RateLimited(Exception):
    """Over a limit: answer 429 with these headers (Retry-After, x-ratelimit-*)."""

    def __init__(self, message: str, retry_after_s: float, headers: dict[str, str]) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s
        self.headers = headers


class MeterBacklogged(Exception):
    """The usage writes waiting on the store (queued, in flight, or held through an outage)
    weigh more than the meter's bound: answer 503 and admit nothing new until they drain, so no
    usage record is dropped and the queue stays bounded in bytes."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ReservationTooLarge(ValueError):
    """A request whose worst case (prompt + max_tokens, and its cost) no counter can hold:
    answer 400, with nothing reserved."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass
class Admission:
    request_id: str
    principal: Principal
    model: str
    reserved_tokens: int
    headers: dict[str, str] = field(default_factory=dict)  # x-ratelimit-* to send back

    @property
    def counts_against_limits(self) -> bool:
        """True when this request's tokens are held in rate-limit or budget counters: then the
        pipeline settles before the answer goes out, so the caller's next request (on any gateway)
        sees this one's real token count, not its admission-time estimate."""
        return False


class Meter(Protocol):
    async def admit(self, request_id: str, principal: Principal, model: str,
                    num_prompt_tokens: int, max_tokens: int) -> Admission: ...

    async def settle(self, admission: Admission, record: UsageRecord) -> None: ...
