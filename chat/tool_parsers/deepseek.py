"""DeepSeek's tool calls, written between its own special tokens (the chat templates of
deepseek-ai/DeepSeek-V3, -R1 and -V3.1 render past calls this way; vLLM's `deepseek_v3` and
`deepseek_v31` parsers read the same):

V3 and R1 (`deepseek_v3`): a type, the name, then the arguments in a fenced JSON block

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1 (`deepseek_v3_1`): the name, then the arguments as they are

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
    <｜tool▁call▁end｜><｜tool▁calls▁end｜>                (one line: no newline between the two)

The outer `<｜tool▁calls▁begin｜>` / `<｜tool▁calls▁end｜>` pair is dropped from the content; each
`<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>` is one call. Arguments must be a JSON object; they are
re-serialized compact. The forced-call grammar spells the markers as text (llguidance's string
literals do not match special tokens), which the parser reads the same way.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import orjson

from chat.tool_parsers.base import ToolCall, ToolParser, arguments_schema

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

# V3's body after the separator: the name on its own line, then the (optionally fenced) JSON
_V3_BODY = re.compile(r"\s*([^\s`]+)[ \t]*\n\s*(?:```(?:json)?[ \t]*\n)?(.*?)\s*(?:```)?\s*",
                      re.DOTALL)


def _object_json(text: str) -> str | None:
    """`text` as compact JSON when it is a JSON object, else None."""
    try:
        arguments = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    return orjson.dumps(arguments).decode() if isinstance(arguments, dict) else None


class _DeepSeekParser(ToolParser):
    start_tag, end_tag = CALL_BEGIN, CALL_END
    block_tags = (CALLS_BEGIN, CALLS_END)

    def call_schema(self, name: str, parameters: dict[str, Any] | None,
                    pointer: str = "") -> dict[str, Any]:
        """The arguments' schema: the name is outside the JSON in DeepSeek's format."""
        del name
        return arguments_schema(parameters, pointer)

    def _call_prefix(self, name: str) -> str:
        """The text of one call before its JSON arguments."""
        raise NotImplementedError

    def _call_suffix(self) -> str:
        return CALL_END

    def calls_grammar(self, functions: Sequence[tuple[str, dict[str, Any] | None]],
                      is_parallel: bool = True) -> str:
        """The calls block: the outer markers around one (or, `is_parallel`, one or more)
        calls, each to one of `functions` with compact JSON arguments following its schema."""
        alternatives = []
        for i, (name, parameters) in enumerate(functions):
            schema = arguments_schema(parameters, "")
            schema["x-guidance"] = {"whitespace_flexible": False}
            prefix = orjson.dumps(self._call_prefix(name)).decode()
            suffix = orjson.dumps(self._call_suffix()).decode()
            alternatives.append(f"call{i}: {prefix} %json {orjson.dumps(schema).decode()} {suffix}")
        calls = "call+" if is_parallel else "call"
        return (f"start: {orjson.dumps(CALLS_BEGIN).decode()} {calls} "
                f"{orjson.dumps(CALLS_END).decode()}\n"
                f"call: {' | '.join(f'call{i}' for i in range(len(functions)))}\n"
                + "\n".join(alternatives) + "\n")


class DeepSeekV3ToolParser(_DeepSeekParser):
    """`TYPE<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```` between the call markers (V3, R1)."""

    def parse_call(self, body: str) -> ToolCall | None:
        kind, sep, rest = body.partition(SEP)
        if not sep or kind.strip() not in ("function", ""):
            return None
        match = _V3_BODY.fullmatch(rest)
        if match is None:
            return None
        arguments = _object_json(match.group(2))
        return None if arguments is None else ToolCall(name=match.group(1), arguments=arguments)

    def _call_prefix(self, name: str) -> str:
        return f"{CALL_BEGIN}function{SEP}{name}\n```json\n"

    def _call_suffix(self) -> str:
        return "\n```" + CALL_END


class DeepSeekV31ToolParser(_DeepSeekParser):
    """`NAME<｜tool▁sep｜>ARGS` between the call markers (V3.1)."""

    def parse_call(self, body: str) -> ToolCall | None:
        name, sep, rest = body.partition(SEP)
        name = name.strip()
        if not sep or not name or any(c.isspace() for c in name):
            return None
        arguments = _object_json(rest.strip())
        return None if arguments is None else ToolCall(name=name, arguments=arguments)

    def _call_prefix(self, name: str) -> str:
        return f"{CALL_BEGIN}{name}{SEP}"
