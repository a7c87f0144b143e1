"""One choice's generated output parsed into the neutral events every dialect maps: answer text,
reasoning text, and tool calls (each call whole, when its closing tag or token arrives).

    parser = chat_format.output_parser(...)          # chat/registry.py picks the family's parts
    for each engine output:  delta = parser.feed(new_token_ids, new_text)
    at the end:              delta = parser.finish()
    OutputDelta(content, reasoning, tool_calls, num_reasoning_tokens)

`TextOutputParser` reads text (a `<think>` splitter, then a tagged tool-call parser over what is
not reasoning); the harmony parser (chat/harmony.py) reads token ids. Streamed and whole answers
go through the same parser, so they agree by construction (`parse_output`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from chat.reasoning import ReasoningDelta, ThinkStream
from chat.tool_parsers import StreamDelta, ToolCall, ToolCallStream


@dataclass(frozen=True, slots=True)
class OutputDelta:
    """What one feed released. `num_reasoning_tokens`: the fed tokens that were reasoning."""

    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    num_reasoning_tokens: int = 0

    def __add__(self, other: OutputDelta) -> OutputDelta:
        return OutputDelta(self.content + other.content, self.reasoning + other.reasoning,
                           self.tool_calls + other.tool_calls,
                           self.num_reasoning_tokens + other.num_reasoning_tokens)


class OutputParser(ABC):
    """Incremental parsing of one answer: `feed` in order, then `finish` once. `num_calls` and
    `num_reasoning_tokens` are the totals released so far."""

    num_calls: int = 0
    num_reasoning_tokens: int = 0

    @abstractmethod
    def feed(self, token_ids: Sequence[int], text: str) -> OutputDelta:
        """The engine's next tokens and their detokenized text."""

    @abstractmethod
    def finish(self) -> OutputDelta:
        """Whatever is still held back (an unterminated call is parsed if it can be)."""


class TextOutputParser(OutputParser):
    """Reasoning split first (`reasoning`, None: the family has none), tool calls parsed from
    the rest (`tools`, None: the request has no tools)."""

    def __init__(self, reasoning: ThinkStream | None, tools: ToolCallStream | None) -> None:
        self._reasoning, self._tools = reasoning, tools
        self._num_undecided_tokens = 0  # fed while the answer may still open with the start tag
        self.num_calls = 0
        self.num_reasoning_tokens = 0

    def feed(self, token_ids: Sequence[int], text: str) -> OutputDelta:
        if self._reasoning is None:
            return self._delta(ReasoningDelta(), self._call_feed(text), 0)
        was_reasoning = self._reasoning.is_reasoning
        split = self._reasoning.feed(text)
        num_reasoning = 0
        if was_reasoning or self._reasoning.is_reasoning or split.reasoning:
            num_reasoning = len(token_ids)
            if not was_reasoning:  # the start tag's tokens, held while undecided, were reasoning
                num_reasoning += self._num_undecided_tokens
        self._num_undecided_tokens = (self._num_undecided_tokens + len(token_ids)
                                      if self._reasoning.is_undecided else 0)
        return self._delta(split, self._call_feed(split.content), num_reasoning)

    def finish(self) -> OutputDelta:
        split = self._reasoning.finish() if self._reasoning else ReasoningDelta()
        tools = self._call_feed(split.content)
        if self._tools is not None:
            rest = self._tools.finish()
            tools = StreamDelta(tools.content + rest.content, tools.tool_calls + rest.tool_calls)
        return self._delta(split, tools, 0)

    def _call_feed(self, content: str) -> StreamDelta:
        if self._tools is None:
            return StreamDelta(content=content)
        return self._tools.feed(content)

    def _delta(self, split: ReasoningDelta, tools: StreamDelta, num_reasoning: int) -> OutputDelta:
        self.num_calls += len(tools.tool_calls)
        self.num_reasoning_tokens += num_reasoning
        return OutputDelta(tools.content, split.reasoning, tools.tool_calls, num_reasoning)


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    """A whole answer: `content` None when it is only calls (and whitespace) or a calls-only
    answer; `reasoning` None when there was none."""

    content: str | None
    reasoning: str | None
    tool_calls: tuple[ToolCall, ...]
    num_reasoning_tokens: int


def parse_output(parser: OutputParser, pieces: Iterable[tuple[Sequence[int], str]],
                 is_calls_only: bool = False) -> ParsedOutput:
    """Feed every (token ids, text) piece, then finish: the whole answer's parts."""
    total = OutputDelta()
    for token_ids, text in pieces:
        total = total + parser.feed(token_ids, text)
    total = total + parser.finish()
    content: str | None = total.content
    if (total.tool_calls or is_calls_only) and not total.content.strip():
        content = None
    return ParsedOutput(content, total.reasoning or None, total.tool_calls,
                        total.num_reasoning_tokens)
