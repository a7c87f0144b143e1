"""Metering settings: prices per model, and limits per project and per key.

Prices are in USD per **million** tokens (the unit price lists use): `input` for uncached prompt
tokens, `cached_input` for prompt tokens served from the prompt cache (defaults to `input`), and
`output` for completion tokens. A model without a price (and no `default_price`) costs 0.

Limits: requests per minute, tokens per minute (prompt + completion) and a daily budget in USD
(UTC day). None = no limit. The project limits apply to all its keys together; the key limits to
each key alone; both must admit a request.
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class ModelPrice(BaseModel):
    input: float = Field(ge=0)  # USD per million prompt tokens
    output: float = Field(ge=0)  # USD per million completion tokens
    cached_input: float | None = Field(default=None, ge=0)  # None = same as input

    @property
    def cached_input_per_million(self) -> float:
        return self.input if self.cached_input is None else self.cached_input


class Limits(BaseModel):
    requests_per_minute: int | None = Field(default=None, gt=0)
    tokens_per_minute: int | None = Field(default=None, gt=0)
    daily_budget_usd: float | None = Field(default=None, gt=0)

    @property
    def any(self) -> bool:
        return (self.requests_per_minute is not None or self.tokens_per_minute is not None
                or self.daily_budget_usd is not None)


class MeteringSettings(BaseModel):
    enabled: bool = True
    prices: dict[str, ModelPrice] = Field(default_factory=dict)
    default_price: ModelPrice | None = None
    default_project_limits: Limits = Field(default_factory=Limits)
    default_key_limits: Limits = Field(default_factory=Limits)
    project_limits: dict[str, Limits] = Field(default_factory=dict)  # project name -> override
    key_limits: dict[str, Limits] = Field(default_factory=dict)  # key id -> override
    record_ttl_days: int = Field(default=90, gt=0)  # Redis: how long per-request records live
    # usage writes waiting on the store (queued, in flight, held through a Redis outage), in
    # bytes of their store calls: past it, new requests are refused (503) until they drain
    backlog_max_bytes: int = Field(default=64 * 1024 * 1024, gt=0)

    def limits_for_project(self, project: str) -> Limits:
        return self.project_limits.get(project, self.default_project_limits)

    def limits_for_key(self, key_id: str) -> Limits:
        return self.key_limits.get(key_id, self.default_key_limits)
