"""What a request costs. Money is counted in integer nano-USD inside the meters (exact sums in
Redis INCRBY and SQLite), and shown as float USD."""

from __future__ import annotations

from gateway.metering.settings import MeteringSettings, ModelPrice

NANOS_PER_USD = 1_000_000_000


def price_for(settings: MeteringSettings, model: str) -> ModelPrice | None:
    return settings.prices.get(model, settings.default_price)


def cost_nanos(settings: MeteringSettings, model: str, prompt_tokens: int, cached_tokens: int,
               completion_tokens: int) -> int:
    """Cost in nano-USD; cached prompt tokens are billed at the cached-input price."""
    price = price_for(settings, model)
    if price is None:
        return 0
    uncached = max(prompt_tokens - cached_tokens, 0)
    # USD per million tokens == nano-USD per token * 1e-3
    nanos = (uncached * price.input + min(cached_tokens, prompt_tokens)
             * price.cached_input_per_million + completion_tokens * price.output) * 1_000
    return round(nanos)


def cost_usd(settings: MeteringSettings, model: str, prompt_tokens: int, cached_tokens: int,
             completion_tokens: int) -> float:
    return cost_nanos(settings, model, prompt_tokens, cached_tokens,
                      completion_tokens) / NANOS_PER_USD
