"""Building the one `UsageRecord` a client request settles with."""

from __future__ import annotations

import time
from collections.abc import Mapping

from auth.principal import Principal
from gateway.metering.contract import UsageRecord
from gateway.request.canonical import (
    Accumulator,
    CanonicalRequest,
    Usage,
    estimate_num_tokens,
    estimate_prompt_tokens,
)
from gateway.settings import ModelSettings

STATUS_CLIENT_CLOSED = 499  # nginx's code for "the client went away before the answer"


def build_record(request: CanonicalRequest, principal: Principal, model: ModelSettings,
                 endpoint_name: str, accumulator: Accumulator, status: int,
                 latency_ms: float, num_prompt_tokens: int | None = None,
                 record_id: str | None = None) -> UsageRecord:
    """Usage as the upstream reported it, else counted from what was produced so far: the
    prompt as the upstream announced it (`PromptUsage`), or `num_prompt_tokens` (the backend's
    count, when the caller made one), or the estimate; the completion from the text and tool calls
    received, of every choice (at least one token per non-empty delta).
    The record's id is `record_id` (unique per gateway request), else the request's id."""
    usage = accumulator.usage or _partial_usage(request, accumulator, num_prompt_tokens)
    return UsageRecord(
        request_id=record_id or request.request_id, project=principal.project,
        key_id=principal.key_id, model=model.name, endpoint=endpoint_name,
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=usage.cached_tokens, completion_tokens=usage.completion_tokens,
        cost_usd=model.prices.cost_usd(usage.prompt_tokens, usage.cached_tokens,
                                       usage.completion_tokens),
        latency_ms=latency_ms, status=status, created_at=time.time(), stream=request.stream,
        finish_reason=accumulator.finish_reason, reasoning_tokens=usage.reasoning_tokens,
        tags=request.tags, session_id=request.usage_session)


COST_REQUEST_HEADER = "x-aigw-cost"  # a request with "1" (or "true") asks for its cost
COST_HEADER = "x-aigw-cost-usd"


def wants_cost(headers: Mapping[str, str]) -> bool:
    return headers.get(COST_REQUEST_HEADER, "").lower() in ("1", "true")


def cost_usd_of(request: CanonicalRequest, model: ModelSettings, accumulator: Accumulator,
                num_prompt_tokens: int | None = None) -> str:
    """The answer's cost as its usage record will count it (build_record's rule), for the
    `x-aigw-cost-usd` header (non-streaming) or the stream's `: x-aigw-cost-usd=` comment line,
    to the nano-dollar."""
    usage = accumulator.usage or _partial_usage(request, accumulator, num_prompt_tokens)
    cost = model.prices.cost_usd(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens)
    return f"{cost:.9f}"


def _partial_usage(request: CanonicalRequest, accumulator: Accumulator,
                   num_prompt_tokens: int | None) -> Usage:
    chars = accumulator.num_generated_chars_by_choice
    echoed = accumulator.num_first_text_chars_by_choice if request.echo else [0] * len(chars)
    deltas = accumulator.num_generated_deltas_by_choice
    num_completion_tokens = sum(
        _completion_estimate(num_chars, num_echoed_chars, num_deltas, request.max_tokens)
        for num_chars, num_echoed_chars, num_deltas in zip(chars, echoed, deltas, strict=True))
    announced = accumulator.prompt_usage
    if announced is not None:
        return Usage(announced.prompt_tokens, num_completion_tokens, announced.cached_tokens)
    if not accumulator.num_events and num_prompt_tokens is None:
        return Usage(0, num_completion_tokens)
    return Usage(estimate_prompt_tokens(request) if num_prompt_tokens is None
                 else num_prompt_tokens, num_completion_tokens)


def _completion_estimate(num_chars: int, num_echoed_chars: int, num_deltas: int,
                         max_tokens: int | None) -> int:
    """One choice's completion from its text and tool calls, at ~4 characters a token but never
    fewer than its `num_deltas` (non-empty deltas sent: each holds at least one token, and short
    tokens, digits or punctuation, are under 4 characters: a digit stream was billed a quarter of
    what it sent); and never past `max_tokens`, which no choice can exceed (the characters
    overshoot on such tokens). `num_echoed_chars`: with `echo`, the choice's first delta (its
    prompt, which is not completion, and its first token) counts as one token."""
    if not num_chars:
        return 0
    num_tokens = 1 if num_echoed_chars else 0
    if num_chars > num_echoed_chars:
        num_tokens += estimate_num_tokens(num_chars - num_echoed_chars)
    num_tokens = max(num_tokens, num_deltas)
    return num_tokens if max_tokens is None else min(num_tokens, max_tokens)
