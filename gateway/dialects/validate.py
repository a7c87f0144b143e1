"""Light, complete validation of JSON bodies: each check names the offending parameter.

Faster than building pydantic models per request; every failure is a `BadRequest` whose message
says which parameter is wrong and what was expected.
"""

from __future__ import annotations

import re
from typing import Any

from contracts.sampling_params import SamplingParams, SamplingParamsError  # pure Python, no torch
from gateway.request.canonical import CanonicalRequest, Message
from gateway.request.errors import BadRequest
from infra.byte_lru import ByteLRU, str_bytes

_MISSING = object()


class InvalidParam(BadRequest):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def _type_name(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
            float: "number", type(None): "null"}.get(type(value), type(value).__name__)


def need_object(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidParam(param, f"expected an object, got {_type_name(value)}")
    return value


def get_str(body: dict[str, Any], key: str, param: str = "", *, required: bool = False,
            allow_empty: bool = True) -> str | None:
    value = body.get(key, _MISSING)
    name = param or key
    if value is _MISSING or value is None:
        if required:
            raise InvalidParam(name, "is required")
        return None
    if not isinstance(value, str):
        raise InvalidParam(name, f"expected a string, got {_type_name(value)}")
    if not allow_empty and not value:
        raise InvalidParam(name, "must not be empty")
    return value


def get_bool(body: dict[str, Any], key: str, param: str = "") -> bool | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise InvalidParam(param or key, f"expected a boolean, got {_type_name(value)}")
    return value


def get_int(body: dict[str, Any], key: str, param: str = "", *, required: bool = False,
            minimum: int | None = None, maximum: int | None = None) -> int | None:
    value = body.get(key)
    name = param or key
    if value is None:
        if required:
            raise InvalidParam(name, "is required")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParam(name, f"expected an integer, got {_type_name(value)}")
    if minimum is not None and value < minimum:
        raise InvalidParam(name, f"must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise InvalidParam(name, f"must be <= {maximum}, got {value}")
    return value


def get_number(body: dict[str, Any], key: str, param: str = "", *, minimum: float | None = None,
               maximum: float | None = None) -> float | None:
    value = body.get(key)
    name = param or key
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidParam(name, f"expected a number, got {_type_name(value)}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise InvalidParam(name, f"must be between {minimum} and {maximum}, got {value}")
    return float(value)


def get_list(body: dict[str, Any], key: str, param: str = "", *, required: bool = False,
             non_empty: bool = False) -> list[Any] | None:
    value = body.get(key)
    name = param or key
    if value is None:
        if required:
            raise InvalidParam(name, "is required")
        return None
    if not isinstance(value, list):
        raise InvalidParam(name, f"expected an array, got {_type_name(value)}")
    if non_empty and not value:
        raise InvalidParam(name, "must not be empty")
    return value


def get_object(body: dict[str, Any], key: str, param: str = "") -> dict[str, Any] | None:
    value = body.get(key)
    if value is None:
        return None
    return need_object(value, param or key)


_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def get_tool_name(body: dict[str, Any], key: str, param: str) -> str:
    """A tool's (function's) name: 1 to 64 ASCII letters, digits, `_` or `-`, the pattern
    OpenAI and Anthropic both require. Another name (a space, a dot, a quote, a newline) would
    reach the chat template's tool list as the model's text, and no upstream would take it."""
    name = get_str(body, key, param, required=True, allow_empty=False) or ""
    if not _TOOL_NAME.fullmatch(name):
        raise InvalidParam(param, "a tool name must match ^[a-zA-Z0-9_-]{1,64}$, got "
                           f"{name[:80]!r}")
    return name


def get_name(body: dict[str, Any], key: str, param: str) -> str | None:
    """An optional name of the same pattern (OpenAI's for a message's `name`: it reaches the
    chat template as the participant's label)."""
    if body.get(key) is None:
        return None
    return get_tool_name(body, key, param)


def get_tool_schema(body: dict[str, Any], key: str, param: str) -> dict[str, Any]:
    """A tool's parameters schema: an object whose `type`, when given, is "object" (a call's
    arguments are an object; OpenAI and Anthropic refuse any other type), else {}."""
    schema = get_object(body, key, param) or {}
    if "type" in schema and schema["type"] != "object":
        raise InvalidParam(f"{param}.type", "a tool's parameters must be a JSON schema of type "
                           f"'object', got {schema['type']!r}")
    return schema


class ToolResults:
    """Reads a conversation in order and refuses a tool result that answers no tool call: one
    must answer a call of the assistant message just before it (only other results between), as
    OpenAI's chat and Anthropic's Messages require, or, with `is_adjacent` False (the Responses
    API's items), of any earlier assistant message. A stray result would otherwise reach the
    model as an unexplained tool turn."""

    def __init__(self, *, is_adjacent: bool = True) -> None:
        self._is_adjacent = is_adjacent
        self._call_ids: set[str] = set()  # the calls a result may answer now

    def add(self, message: Message, param: str) -> None:
        """`message` is the next one of the conversation; `param` names it in an error."""
        if message.role == "assistant":
            if self._is_adjacent:
                self._call_ids.clear()
            self._call_ids.update(call.id for call in message.tool_calls)
        elif message.role != "tool":
            if self._is_adjacent:
                self._call_ids.clear()
        elif message.tool_call_id not in self._call_ids:
            if not self._call_ids:
                raise InvalidParam(param, "a tool result must follow an assistant message with "
                                   "tool calls")
            where = "the assistant message just before it" if self._is_adjacent else "the input"
            raise InvalidParam(param, f"tool result {message.tool_call_id!r} answers no tool "
                               f"call of {where}")


def get_stop(body: dict[str, Any], key: str, *, max_items: int = 4) -> list[str]:
    value = body.get(key)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if (not isinstance(value, list) or len(value) > max_items
            or not all(isinstance(item, str) for item in value)):
        raise InvalidParam(key, f"expected a string or an array of at most {max_items} strings")
    return list(value)


# combinations already checked (clients repeat theirs), bounded in bytes: a key holds the
# request's stop strings, which a caller chooses (a count bound alone let 4,096 keys of 32 MiB
# stop strings each hold gigabytes)
_VALID_SAMPLING: ByteLRU[tuple[Any, ...], bool] = ByteLRU(1 << 20, max_entry_bytes=4096)
_SAMPLING_KEY_BYTES = 256  # the key's tuple and its numbers, about


def check_sampling(request: CanonicalRequest, param_names: dict[str, str] | None = None) -> None:
    """The replica's own ranges (contracts.sampling_params), checked here so that a value the
    replica would refuse (e.g. top_p = 0) is a normal 400 naming its parameter. `param_names` maps
    the canonical field to the dialect's name (e.g. {"stop": "stop_sequences"})."""
    key = (request.temperature, request.top_p, request.top_k, request.max_tokens, request.echo,
           *request.stop)
    if _VALID_SAMPLING.get(key):
        return
    try:
        SamplingParams(temperature=1.0 if request.temperature is None else request.temperature,
                       top_p=1.0 if request.top_p is None else request.top_p, top_k=request.top_k,
                       max_tokens=request.max_tokens, stop=tuple(request.stop),
                       prompt_logprobs=0 if request.echo else None)
        _VALID_SAMPLING.put(key, True, _SAMPLING_KEY_BYTES + sum(map(str_bytes, request.stop)))
    except SamplingParamsError as exc:
        message = str(exc)
        field = message.split(" ", 1)[0]
        field = "stop" if "stop sequence" in message else field
        raise InvalidParam((param_names or {}).get(field, field), message) from None
