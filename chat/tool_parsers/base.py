"""ToolParser: turns a model's raw completion text into OpenAI tool calls.

A parser knows one model family's tagged format (`<tool_call>...</tool_call>` for Hermes-style
models). It has two faces:

- `extract(text)` for a finished completion: every well-formed call, and the text around them.
- `stream()` for streaming: a `ToolCallStream` that is fed text deltas and hands back the content
  that is safe to show and the calls completed so far. Text is held back from the moment a start
  tag *may* be forming (a suffix that is a prefix of the tag) until it is known not to be one, so
  a client never sees a half-printed `<tool_ca`.

A tag whose body cannot be parsed (bad JSON, no name) is not a call: its raw text is content.

`calls_grammar(functions)` is the format as a grammar (Lark, llguidance's dialect): one or more
calls to the given functions, arguments following each one's JSON schema. The replica constrains
decoding with it when `tool_choice` demands a call (engine/structured_output.py).
"""

from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

# llguidance JSON options: no free whitespace, items and keys separated as json.dumps does
TEMPLATE_JSON_SPACING = {"whitespace_flexible": False, "item_separator": ", ",
                         "key_separator": ": "}


def new_tool_call_id() -> str:
    """An OpenAI-style call id: `call_` + 24 random alphanumerics."""
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    return "call_" + "".join(secrets.choice(alphabet) for _ in range(24))


@dataclass(frozen=True)
class ToolCall:
    """One function call; `arguments` is a JSON string, as OpenAI sends it."""

    name: str
    arguments: str
    id: str = field(default_factory=new_tool_call_id)


@dataclass(frozen=True)
class ParsedToolCalls:
    """`content` is the text outside the calls (None when only whitespace was left)."""

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class StreamDelta:
    """What a streaming feed released: text safe to show now, and calls completed now."""

    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()


class ToolParser(ABC):
    """A tagged tool-call format: subclasses give the tags and parse one call's body."""

    start_tag: str
    end_tag: str
    # the markers of a block holding the calls (DeepSeek's `<｜tool▁calls▁begin｜>` ...
    # `<｜tool▁calls▁end｜>`), or (): no text, dropped from the content and held back like the
    # start tag while they may be forming; whitespace between calls inside the block is dropped
    block_tags: tuple[str, ...] = ()

    @abstractmethod
    def parse_call(self, body: str) -> ToolCall | None:
        """The call inside one start/end tag pair, or None when the body is not a valid call."""

    @abstractmethod
    def call_schema(self, name: str, parameters: dict[str, Any] | None,
                    pointer: str = "") -> dict[str, Any]:
        """The JSON schema of one call's body (between the tags) to the function `name`, placed
        at JSON pointer `pointer` of the grammar's schema (its arguments: `arguments_schema`)."""

    def calls_grammar(self, functions: Sequence[tuple[str, dict[str, Any] | None]],
                      is_parallel: bool = True) -> str:
        """A Lark grammar: tagged calls (one, or with `is_parallel` one or more), each to one of
        `functions` ((name, JSON schema of its arguments) pairs), each body JSON spaced as
        `json.dumps` spaces it: the chat template's `tojson` renders the call that way when the
        conversation comes back (chat/chat_template.py `tool_call_text`), so the next turn's
        prompt repeats the call's tokens and its prefix cache reaches past the call (compact
        JSON stopped the cache at the call's first `":`)."""
        schema = {"anyOf": [self.call_schema(name, parameters, f"/anyOf/{i}")
                            for i, (name, parameters) in enumerate(functions)],
                  "x-guidance": TEMPLATE_JSON_SPACING}
        start, end = (orjson.dumps(self.start_tag + "\n").decode(),
                      orjson.dumps("\n" + self.end_tag).decode())
        calls = "call+" if is_parallel else "call"
        return (f'start: {calls}\n'
                f'call: {start} %json {orjson.dumps(schema).decode()} {end} "\\n"?\n')

    def extract(self, text: str, is_calls_only: bool = False) -> ParsedToolCalls:
        """All calls in a finished completion; an unterminated last tag is parsed if it can be.
        `is_calls_only`: decoding was constrained to calls (`calls_grammar`), see `stream`."""
        stream = self.stream(is_calls_only)
        first = stream.feed(text)
        last = stream.finish()
        content = first.content + last.content
        calls = first.tool_calls + last.tool_calls
        if (calls or is_calls_only) and not content.strip():
            return ParsedToolCalls(content=None, tool_calls=calls)
        return ParsedToolCalls(content=content, tool_calls=calls)

    def stream(self, is_calls_only: bool = False) -> ToolCallStream:
        """`is_calls_only`: the answer was decoded under `calls_grammar`, so whatever is not a whole
        call is a call max_tokens cut off: it is dropped, never shown as text."""
        return ToolCallStream(self, is_calls_only)


class ToolCallStream:
    """Incremental parsing for one completion; `feed` deltas in order, then `finish` once."""

    def __init__(self, parser: ToolParser, is_calls_only: bool = False) -> None:
        self._parser = parser
        self._pending = ""  # text not yet released: a possible start tag, or an open call
        self._in_call = False
        self._in_block = False  # inside the parser's block_tags
        # whitespace outside calls, held until text follows: an answer of calls and whitespace
        # (the "\n" after a call) streams no content, as `extract` returns none for it
        self._blank = ""
        self._has_text = False
        # a call (or, decoding constrained to calls, the start), then only whitespace: a tag cut
        # off after it is a call max_tokens ended, not text
        self._ends_with_call = is_calls_only
        self.num_calls = 0

    def feed(self, text: str) -> StreamDelta:
        self._pending += text
        content: list[str] = []
        calls: list[ToolCall] = []
        start, end = self._parser.start_tag, self._parser.end_tag
        while True:
            if self._in_call:
                end_at = self._pending.find(end)
                if end_at < 0:
                    break
                body = self._pending[:end_at]
                self._pending = self._pending[end_at + len(end):]
                self._in_call = False
                call = self._parser.parse_call(body)
                if call is None:
                    self._release(content, start + body + end)
                else:
                    calls.append(call)
                    self._ends_with_call = True
                continue
            tag, tag_at = self._first_tag()
            if tag_at >= 0:
                self._release(content, self._pending[:tag_at])
                self._pending = self._pending[tag_at + len(tag):]
                self._in_call = tag == start
                if not self._in_call:
                    self._in_block = tag == self._parser.block_tags[0]
                continue
            keep = max(_partial_suffix_len(self._pending, t)
                       for t in (start, *self._parser.block_tags))
            self._release(content, self._pending[: len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep:]
            break
        self.num_calls += len(calls)
        return StreamDelta(content=self._shown("".join(content)), tool_calls=tuple(calls))

    def _first_tag(self) -> tuple[str, int]:
        """The start tag or block tag that comes first in the pending text, and where (-1:
        none)."""
        first, first_at = self._parser.start_tag, self._pending.find(self._parser.start_tag)
        for tag in self._parser.block_tags:
            at = self._pending.find(tag)
            if at >= 0 and (first_at < 0 or at < first_at):
                first, first_at = tag, at
        return first, first_at

    def _release(self, content: list[str], text: str) -> None:
        if self._in_block and not text.strip():
            return  # the separator between two calls of a block
        content.append(text)
        if text.strip():
            self._ends_with_call = False

    def _shown(self, content: str) -> str:
        """The part of released `content` to show now: whitespace waits for text."""
        if self._has_text:
            return content
        if not content.strip():
            self._blank += content
            return ""
        self._has_text = True
        content, self._blank = self._blank + content, ""
        return content

    def finish(self) -> StreamDelta:
        """Release what is left: an unterminated call is parsed if possible (also when its end tag
        was cut: '{"name": "a", "arguments": {}}\n</tool_ca'), else shown as text;
        whitespace still held back is dropped when the answer has calls (`extract`: content None).
        After complete calls and nothing but whitespace (or anywhere in a calls-only answer), a
        cut-off tag or call (max_tokens ended the next call: "<tool_ca", '<tool_call>{"name": "ge')
        is dropped, not shown as text."""
        pending, self._pending = self._pending, ""
        calls: tuple[ToolCall, ...] = ()
        if not self._in_call:
            content = "" if self._ends_with_call else pending
        else:
            self._in_call = False
            call = self._parser.parse_call(pending)
            if call is None and (cut := _partial_suffix_len(pending, self._parser.end_tag)):
                call = self._parser.parse_call(pending[:-cut])  # the end tag itself was cut off
            calls = () if call is None else (call,)
            content = ("" if call is not None or self._ends_with_call
                       else self._parser.start_tag + pending)
        self.num_calls += len(calls)
        content = self._shown(content)
        if not self._has_text and not self.num_calls:  # a blank answer without calls is content
            content, self._blank = self._blank, ""
        return StreamDelta(content=content, tool_calls=calls)


_DATA_KEYWORDS = frozenset({"const", "default", "enum", "examples"})  # values, not schemas
_SCHEMA_MAPS = frozenset({"$defs", "definitions", "dependentSchemas", "patternProperties",
                          "properties"})  # name -> schema


_OPEN_KEYWORDS = frozenset({"additionalProperties", "patternProperties", "unevaluatedProperties"})


def arguments_schema(parameters: dict[str, Any] | None, pointer: str) -> dict[str, Any]:
    """A function's parameters schema as the schema of a call's arguments placed at JSON pointer
    `pointer` of a larger schema: an object (without a `type` it would admit any JSON, e.g. an
    array, which is no call), and each local `$ref` rebased there (pydantic's "#/$defs/X"
    becomes "#<pointer>/$defs/X"; unchanged, it would point into the larger schema's root).

    The object is closed, as OpenAI's strict mode reads a tool's schema: the top level, and every
    object below it that lists `properties`, gets `additionalProperties: false` unless it says
    how extra keys are treated (`additionalProperties`, `patternProperties`,
    `unevaluatedProperties`). JSON Schema's default admits any further key, and a forced call
    under such a schema (LangChain sends none) let a small model add keys until max_tokens."""
    schema: dict[str, Any] = _rebased({"type": "object", **(parameters or {})}, pointer)
    if not _OPEN_KEYWORDS & schema.keys():
        schema["additionalProperties"] = False
    return schema


def _rebased(schema: Any, pointer: str) -> Any:
    """`schema` with local refs rebased under `pointer`, and each nested object schema that
    lists `properties` closed (see `arguments_schema`)."""
    if isinstance(schema, list):
        return [_rebased(item, pointer) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rebased: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            rebased[key] = "#" + pointer + value[1:]
        elif key in _DATA_KEYWORDS:
            rebased[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            rebased[key] = {name: _rebased(sub, pointer) for name, sub in value.items()}
        else:
            rebased[key] = _rebased(value, pointer)
    if isinstance(schema.get("properties"), dict) and not _OPEN_KEYWORDS & schema.keys():
        rebased["additionalProperties"] = False
    return rebased


def _partial_suffix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
