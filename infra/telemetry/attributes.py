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

OPERATION_BY_KIND = {"chat": "chat", "completion": "text_completion"}


def exception_attributes(exception: BaseException, escaped: bool = False) -> dict[str, Any]:
    """The OpenTelemetry `exception` event's attributes (what the SDK's `record_exception` writes)."""
    kind = type(exception)
    module = kind.__module__
    return {"exception.type": f"{module}.{kind.__qualname__}" if module and module != "builtins"
            else kind.__qualname__,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped)}
