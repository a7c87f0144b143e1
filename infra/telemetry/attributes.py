"""Span attribute names: OpenTelemetry GenAI semantic conventions, plus ours (`aigw.*`); and the
`exception` event's attributes."""

from __future__ import annotations

import traceback
from typing import Any

GEN_AI_OPERATION = "gen_ai.operation.name"  # "chat" | "text_completion"
GEN_AI_SYSTEM = "gen_ai.system"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"

AIGW_PROJECT = "aigw.project"
AIGW_KEY_ID = "aigw.key_id"
AIGW_REPLICA = "aigw.replica"
AIGW_CACHED_TOKENS = "aigw.cached_tokens"
AIGW_COST_USD = "aigw.cost_usd"
AIGW_REQUEST_ID = "aigw.request_id"
AIGW_STREAM = "aigw.stream"
AIGW_ROUTING_POLICY = "aigw.routing.policy"
AIGW_ROUTING_REASON = "aigw.routing.reason"
AIGW_ROUTING_CANDIDATES = "aigw.routing.candidates"
AIGW_ROUTING_MATCHED_BLOCKS = "aigw.routing.matched_blocks"  # one per candidate, same order
AIGW_ROUTING_SCORES = "aigw.routing.scores"  # the router's cost per candidate (lower wins)
AIGW_ROUTING_EXPLAIN = "aigw.routing.explain"
AIGW_ROUTING_MODEL = "aigw.routing.model"  # the model whose endpoints were chosen among
AIGW_FALLBACK_FROM = "aigw.fallback.from_model"
AIGW_FALLBACK_TO = "aigw.fallback.to_model"
AIGW_FALLBACK_REASON = "aigw.fallback.reason"  # gateway/request/fallback.py FALLBACK_REASONS
AIGW_FALLBACK_ERROR = "aigw.fallback.error_code"  # the error code the model ended with
AIGW_CACHE_SESSION_TURN = "aigw.cache.session_turn"  # the request's turn in its session
AIGW_CACHE_DIVERGENCE = "aigw.cache.divergence"  # "none", or what changed from the last turn
AIGW_CACHE_DIVERGENCE_TOKEN = "aigw.cache.divergence_token"  # tokens shared with the last turn
AIGW_CACHE_DIVERGENCE_EXACT = "aigw.cache.divergence_exact"  # from token ids, not estimated

OPERATION_BY_KIND = {"chat": "chat", "completion": "text_completion"}


MAX_EXCEPTION_MESSAGE_CHARS = 1024
MAX_EXCEPTION_STACKTRACE_CHARS = 4096  # the innermost frames are kept


def exception_attributes(exception: BaseException, escaped: bool = False) -> dict[str, Any]:
    """The OpenTelemetry `exception` event's attributes (what the SDK's `record_exception` writes),
    the message and the stack trace cut to a bound: trace buffers hold spans by count, so each
    span's attributes must be bounded in bytes (an error can quote a whole request)."""
    kind = type(exception)
    module = kind.__module__
    message = str(exception)
    if len(message) > MAX_EXCEPTION_MESSAGE_CHARS:
        message = message[:MAX_EXCEPTION_MESSAGE_CHARS] + "..."
    stacktrace = "".join(traceback.format_exception(exception))
    if len(stacktrace) > MAX_EXCEPTION_STACKTRACE_CHARS:  # the innermost frames, then the message
        frames = "".join(traceback.format_tb(exception.__traceback__))
        room = max(0, MAX_EXCEPTION_STACKTRACE_CHARS - len(message) - 100)
        stacktrace = (f"Traceback (most recent call last, cut):\n...\n{frames[-room:]}"
                      f"{kind.__qualname__}: {message}\n")
    return {"exception.type": f"{module}.{kind.__qualname__}" if module and module != "builtins"
            else kind.__qualname__,
            "exception.message": message,
            "exception.stacktrace": stacktrace,
            "exception.escaped": str(escaped)}
