"""Metering settings: prices per model, and limits per project and per key.

Prices are in USD per **million** tokens (the unit price lists use): `input` for uncached prompt
tokens, `cached_input` for prompt tokens served from the prompt cache (defaults to `input`), and
`output` for completion tokens. A model without a price (and no `default_price`) costs 0.

Limits: requests per minute, tokens per minute (prompt + completion), requests in flight at once,
and USD budgets over a UTC day, a UTC month or a custom window (gateway/metering/budgets.py;
`daily_budget_usd` is the config file's short form of a day budget). None = no limit. The project
limits apply to all its keys together; the key limits to each key alone; both must admit a
request. Limits set through the admin API (gateway/metering/limit_store.py) replace these for
their scope.
"""

from __future__ import annotations

from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, model_validator

from gateway.metering.budgets import Budget

MAX_BUDGETS = 4


class ModelPrice(BaseModel):
    input: float = Field(ge=0)  # USD per million prompt tokens
    output: float = Field(ge=0)  # USD per million completion tokens
    cached_input: float | None = Field(default=None, ge=0)  # None = same as input

    @property
    def cached_input_per_million(self) -> float:
        return self.input if self.cached_input is None else self.cached_input


class Limits(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    requests_per_minute: int | None = Field(default=None, gt=0, le=2**40)
    tokens_per_minute: int | None = Field(default=None, gt=0, le=2**50)
    max_concurrent_requests: int | None = Field(default=None, gt=0, le=2**20)
    daily_budget_usd: float | None = Field(default=None, gt=0, le=1e9)
    budgets: tuple[Budget, ...] = Field(default=(), max_length=MAX_BUDGETS)
    # where the budgets' alert_at thresholds are POSTed, signed with webhook_secret (HMAC-SHA256)
    webhook_url: AnyHttpUrl | None = None
    webhook_secret: str | None = Field(default=None, min_length=16, max_length=256)

    @model_validator(mode="after")
    def _check(self) -> Limits:
        kinds = [b.kind for b in self.all_budgets]
        if len(set(kinds)) != len(kinds):
            raise ValueError("at most one budget per window (daily_budget_usd is a day budget)")
        if (self.webhook_url is None) != (self.webhook_secret is None):
            raise ValueError("webhook_url and webhook_secret go together")
        return self

    @property
    def all_budgets(self) -> tuple[Budget, ...]:
        """`budgets`, with `daily_budget_usd` as a day budget first."""
        if self.daily_budget_usd is None:
            return self.budgets
        return (Budget(usd=self.daily_budget_usd, window="day"), *self.budgets)

    @property
    def any(self) -> bool:
        return (self.requests_per_minute is not None or self.tokens_per_minute is not None
                or self.max_concurrent_requests is not None or bool(self.all_budgets))

    def public_view(self) -> dict[str, object]:
        """As the admin API shows it: the webhook secret never leaves the store."""
        view = self.model_dump(mode="json", exclude={"webhook_secret"})
        view["webhook_secret_set"] = self.webhook_secret is not None
        return view


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
