"""Pieces shared by the OpenAI dialects: the error envelope, usage JSON, SSE framing, sampling."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.dialects.validate import (
    InvalidParam,
    check_sampling,
    get_bool,
    get_int,
    get_number,
    get_object,
    get_stop,
    get_str,
)
from gateway.request.canonical import CanonicalRequest, Usage

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}


def error_body(status: int, code: str, message: str, param: str | None = None,
               error_type: str | None = None) -> dict[str, Any]:
    error_type = error_type or _ERROR_TYPES.get(
        status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def sse_data(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
# OpenAI's own bound on `n` (an upstream may allow fewer: its 400 passes through)
MAX_NUM_CHOICES = 128


def usage_json(usage: Usage | None) -> dict[str, Any]:
    """Chat and completions usage; `completion_tokens_details` when some tokens were reasoning."""
    usage = usage or Usage(0, 0)
    body = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}
    if usage.reasoning_tokens:
        body["completion_tokens_details"] = {"reasoning_tokens": usage.reasoning_tokens}
    return body


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


def parse_reasoning_effort(value: Any, param: str) -> str | None:
    """OpenAI's reasoning_effort: None or one of REASONING_EFFORTS."""
    if value is None:
        return None
    if value not in REASONING_EFFORTS:
        raise InvalidParam(param, f"must be one of {', '.join(REASONING_EFFORTS)}")
    return str(value)


# prompt_cache_retention (Azure's documents spell the first "in-memory") and
# prompt_cache_options.ttl, in seconds: OpenAI's in-memory caches live 5 to 10 minutes
PROMPT_CACHE_RETENTION_S = {"in_memory": 300.0, "in-memory": 300.0, "24h": 86_400.0}
PROMPT_CACHE_TTL_S = {"30m": 1800.0}


def parse_cache_retention(body: dict[str, Any]) -> float | None:
    """How long the prompt's prefix should stay cached, in seconds: the longer of
    `prompt_cache_retention` ("in_memory" / "24h") and `prompt_cache_options.ttl` ("30m");
    None when neither is given."""
    found: list[float] = []
    retention = body.get("prompt_cache_retention")
    if retention is not None:
        if retention not in PROMPT_CACHE_RETENTION_S:
            raise InvalidParam("prompt_cache_retention", "must be 'in_memory' or '24h'")
        found.append(PROMPT_CACHE_RETENTION_S[retention])
    options = get_object(body, "prompt_cache_options")
    if options is not None and options.get("ttl") is not None:
        if options["ttl"] not in PROMPT_CACHE_TTL_S:
            raise InvalidParam("prompt_cache_options.ttl", "must be '30m'")
        found.append(PROMPT_CACHE_TTL_S[options["ttl"]])
    return max(found) if found else None


SERVICE_TIERS = ("auto", "default", "flex", "priority", "fast", "scale")


def parse_service_tier(body: dict[str, Any]) -> str | None:
    """OpenAI's `service_tier` as a scheduling class ("priority", "default", "flex"); None for
    "auto" or none given (the project's default class). "fast" is "priority"; "scale" (reserved
    capacity, which is not offered) is "default"."""
    value = body.get("service_tier")
    if value is None or value == "auto":
        return None
    if value not in SERVICE_TIERS:
        raise InvalidParam("service_tier", "must be one of 'auto', 'default', 'flex', 'priority'")
    return {"fast": "priority", "scale": "default"}.get(str(value), str(value))


_IDENTITY_KEYS = frozenset(("user", "prompt_cache_key"))
_SAMPLING_KEYS = frozenset(("temperature", "top_p", "presence_penalty", "frequency_penalty", "n",
                            "seed"))


def parse_sampling(body: dict[str, Any], request: CanonicalRequest, *,
                   max_tokens_keys: tuple[str, ...]
                   ) -> None:
    """temperature, top_p, penalties, n, seed, stop, max tokens, stream, stream_options, user
    prompt_cache_key and the prompt cache retention onto `request`
    (max tokens may be 0 only on a completion that echoes its prompt: it scores the prompt)."""
    if not _IDENTITY_KEYS.isdisjoint(body):  # (absent: the request's defaults stand, no calls)
        request.user = get_str(body, "user")
        request.prompt_cache_key = get_str(body, "prompt_cache_key")
    request.cache_retention_s = parse_cache_retention(body)
    request.service_tier = parse_service_tier(body)
    for key in max_tokens_keys:
        value = get_int(body, key, minimum=0 if request.echo else 1)
        if value is not None:
            request.max_tokens = value
    if not _SAMPLING_KEYS.isdisjoint(body):  # (a body that sets none: the defaults, no calls)
        request.temperature = get_number(body, "temperature", minimum=0.0, maximum=2.0)
        request.top_p = get_number(body, "top_p", minimum=0.0, maximum=1.0)
        request.presence_penalty = get_number(body, "presence_penalty", minimum=-2.0, maximum=2.0)
        request.frequency_penalty = get_number(body, "frequency_penalty", minimum=-2.0,
                                               maximum=2.0)
        request.n = get_int(body, "n", minimum=1, maximum=MAX_NUM_CHOICES) or 1
        request.seed = get_int(body, "seed", minimum=-(1 << 63), maximum=(1 << 63) - 1)
    request.stop = get_stop(body, "stop")
    request.stream = bool(get_bool(body, "stream"))
    options = get_object(body, "stream_options")
    if options is not None:
        if not request.stream:
            raise InvalidParam("stream_options", "is only allowed when stream is true")
        request.include_usage = bool(get_bool(options, "include_usage",
                                              "stream_options.include_usage"))
    check_sampling(request, {"max_tokens": max_tokens_keys[0]})


def parse_output_format(value: Any, param: str, *, is_flat: bool = False) -> dict[str, Any] | None:
    """Chat's `response_format` (or, `is_flat`, the Responses API's `text.format`: name and
    schema beside type) in chat's form, or None for plain text. The schema itself is checked
    where the grammar is compiled (the replica; its 400 passes through)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise InvalidParam(f"{param}.type", "expected text, json_object or json_schema")
    spec = value if is_flat else get_object(value, "json_schema", f"{param}.json_schema")
    where = param if is_flat else f"{param}.json_schema"
    if spec is None:
        raise InvalidParam(where, "is required when type is json_schema")
    found: dict[str, Any] = {"name": get_str(spec, "name", f"{where}.name", required=True,
                                             allow_empty=False)}
    schema = get_object(spec, "schema", f"{where}.schema")
    if schema is not None:
        found["schema"] = schema
    description = get_str(spec, "description", f"{where}.description")
    if description is not None:
        found["description"] = description
    strict = get_bool(spec, "strict", f"{where}.strict")
    if strict is not None:
        found["strict"] = strict
    return {"type": "json_schema", "json_schema": found}


MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat (the legacy completions API allows 5)


def parse_chat_logprobs(body: dict[str, Any], request: CanonicalRequest) -> None:
    """Chat's `logprobs` (bool) and `top_logprobs` (0-20, only with logprobs) onto `request`."""
    request.logprobs = bool(get_bool(body, "logprobs"))
    request.top_logprobs = get_int(body, "top_logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS) or 0
    if request.top_logprobs and not request.logprobs:
        raise InvalidParam("top_logprobs", "requires logprobs to be true")


def joined_logprobs(parts: list[Any] | None) -> Any:
    """One logprobs object from a choice's per-delta objects (each in the upstream's own OpenAI
    form: chat `{"content": [...]}`, or the legacy completions form of parallel arrays)."""
    if not parts:
        return None
    if all(isinstance(p, dict) and "content" in p for p in parts):  # chat: refusal always there
        return {"content": [entry for p in parts for entry in p.get("content") or ()],
                "refusal": None}
    joined: dict[str, list[Any]] = {}
    for part in parts:
        for key, values in (part.items() if isinstance(part, dict) else ()):
            if isinstance(values, list):
                joined.setdefault(key, []).extend(values)
    return joined


def logprobs_bytes(logprobs: Any) -> bytes:
    """A delta's logprobs as JSON; chat's form (`content`) always carries `refusal` (null when
    the upstream left it out), as OpenAI sends it."""
    if isinstance(logprobs, dict) and "content" in logprobs and "refusal" not in logprobs:
        logprobs = {**logprobs, "refusal": None}
    return b"null" if logprobs is None else orjson.dumps(logprobs)
