"""Reasoning parsers: a model's thinking split out of its answer text.

`<think>...</think>` (Qwen3, Qwen3-MoE, DeepSeek-R1 and its distills, QwQ):

    <think>\\nLet me add the numbers.\\n</think>\\n\\nThe sum is 4.
    -> reasoning "Let me add the numbers."   content "The sum is 4."

Where the reasoning starts is the prompt's business, so `ThinkStream` takes it as an argument:
  - `starts_in_reasoning=True`: the rendered prompt already opened `<think>` (DeepSeek-R1's
    template, Qwen3 "thinking-2507"): everything up to `</think>` is reasoning.
  - otherwise the answer may open with `<think>` (after leading whitespace only); an answer that
    does not is all content. Qwen3's `enable_thinking=False` renders an empty
    `<think>\\n\\n</think>\\n\\n` into the prompt, so its answer is content from the first token.

Newlines right after `<think>`, before `</think>` and right after `</think>` are dropped (as the
Qwen3 model card's parsing example strips them). A reasoning block never closed (max_tokens cut
it) stays reasoning. Streaming holds back text only while it may still be a tag or such
whitespace, so a client never sees a half-printed `</thi`.

The harmony analysis channel (gpt-oss) is parsed from token ids in chat/harmony.py.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """What a feed released: reasoning text and answer text, each safe to show now."""

    reasoning: str = ""
    content: str = ""


def opens_reasoning(prompt_text: str, start_tag: str = THINK_START) -> bool:
    """True when the rendered prompt ends with an opened reasoning block (only whitespace after
    the start tag): the answer starts in reasoning."""
    return prompt_text.rstrip().endswith(start_tag)


class ThinkStream:
    """Incremental `<think>` splitting for one answer: `feed` text deltas in order, then
    `finish` once. `is_reasoning` says whether the text fed so far ends inside reasoning."""

    def __init__(self, starts_in_reasoning: bool = False, start_tag: str = THINK_START,
                 end_tag: str = THINK_END) -> None:
        self._start_tag, self._end_tag = start_tag, end_tag
        # "open": the answer may still begin with the start tag; "reasoning"; "content"
        self._state = "reasoning" if starts_in_reasoning else "open"
        self._pending = ""  # text not yet released (a possible tag, or held whitespace)
        self._at_block_start = starts_in_reasoning  # drop newlines right after <think>
        self._after_end = False  # drop newlines right after </think>

    @property
    def is_reasoning(self) -> bool:
        return self._state == "reasoning"

    @property
    def is_undecided(self) -> bool:
        """Nothing released yet: the text held may still be the start tag."""
        return self._state == "open"

    def feed(self, text: str) -> ReasoningDelta:
        self._pending += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._pending:
            if self._state == "open":
                stripped = self._pending.lstrip()
                if stripped.startswith(self._start_tag):
                    self._pending = stripped[len(self._start_tag):]
                    self._state, self._at_block_start = "reasoning", True
                    continue
                if not stripped or self._start_tag.startswith(stripped):
                    break  # still may become the start tag
                self._state = "content"
                continue
            if self._state == "reasoning":
                if self._at_block_start:
                    self._pending = self._pending.lstrip("\n")
                    if not self._pending:
                        break
                    self._at_block_start = False
                end_at = self._pending.find(self._end_tag)
                if end_at >= 0:
                    reasoning.append(self._pending[:end_at].rstrip("\n"))
                    self._pending = self._pending[end_at + len(self._end_tag):]
                    self._state, self._after_end = "content", True
                    continue
                # held: a possible end tag, and the newlines before it (dropped if it closes)
                cut = partial_suffix_len(self._pending, self._end_tag)
                head = self._pending[:len(self._pending) - cut]
                keep = cut + len(head) - len(head.rstrip("\n"))
                reasoning.append(self._pending[:len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
                break
            if self._after_end:  # content right after </think>: its leading newlines go
                self._pending = self._pending.lstrip("\n")
                if not self._pending:
                    break
                self._after_end = False
            content.append(self._pending)
            self._pending = ""
        return ReasoningDelta("".join(reasoning), "".join(content))

    def finish(self) -> ReasoningDelta:
        """Release what is held: an unclosed block's text is reasoning (its held newlines and a
        cut-off end tag are dropped), an open answer's text is content."""
        pending, self._pending = self._pending, ""
        if self._state == "reasoning":
            cut = partial_suffix_len(pending, self._end_tag)
            return ReasoningDelta(reasoning=pending[:len(pending) - cut].rstrip("\n"))
        if self._state == "open" and not pending.strip():
            return ReasoningDelta(content=pending)
        return ReasoningDelta(content=pending.lstrip("\n") if self._after_end else pending)


def split_reasoning(text: str, starts_in_reasoning: bool = False) -> ReasoningDelta:
    """A finished answer split whole (what streaming the same text yields, joined)."""
    stream = ThinkStream(starts_in_reasoning)
    first, last = stream.feed(text), stream.finish()
    return ReasoningDelta(first.reasoning + last.reasoning, first.content + last.content)


def partial_suffix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
