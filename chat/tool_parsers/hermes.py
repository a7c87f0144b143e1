"""Hermes-style tool calls (SmolLM2, Qwen2/2.5/3, NousHermes):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Several calls may follow each other; whitespace around the JSON is ignored. `arguments` (or
`parameters`, which some fine-tunes emit) may be an object or a JSON string; it is re-serialized
as a compact JSON string.
"""

from __future__ import annotations

from typing import Any

import orjson

from chat.tool_parsers.base import ToolCall, ToolParser, arguments_schema


class HermesToolParser(ToolParser):
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def parse_call(self, body: str) -> ToolCall | None:
        try:
            payload = orjson.loads(body.strip())
        except orjson.JSONDecodeError:
            return None
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            return None
        arguments = payload.get("arguments", payload.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = orjson.loads(arguments)
            except orjson.JSONDecodeError:
                return None
        if not isinstance(arguments, dict):
            return None
        return ToolCall(name=payload["name"], arguments=orjson.dumps(arguments).decode())

    def call_schema(self, name: str, parameters: dict[str, Any] | None,
                    pointer: str = "") -> dict[str, Any]:
        arguments = arguments_schema(parameters, f"{pointer}/properties/arguments")
        return {"type": "object", "properties": {"name": {"const": name}, "arguments": arguments},
                "required": ["name", "arguments"], "additionalProperties": False}
