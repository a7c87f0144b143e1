"""ChoiceState: one choice's accumulated output, and usage summed over choices."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from contracts.usage_headers import CACHED_TOKENS_HEADER, PROMPT_TOKENS_HEADER
from engine.outputs import RequestOutput, TokenLogprob
from engine.server.fanout import FanOut
from engine.server.responses import usage


@dataclass
class ChoiceState:
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None  # from the first output, when asked
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or token id that matched (vLLM's field)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    num_reasoning_tokens: int = 0  # of num_output_tokens, set by the answer's output parser

    def add(self, output: RequestOutput) -> None:
        """Fold in one engine output (counters are totals, so the latest wins)."""
        self.text_parts.append(output.text)
        if output.logprobs:
            self.logprobs.extend(output.logprobs)
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        if output.finish_reason is not None:
            self.finish_reason = str(output.finish_reason)
            self.stop_reason = output.stop_reason
        self.num_prompt_tokens = output.num_prompt_tokens
        self.num_cached_tokens = output.num_cached_tokens
        self.num_output_tokens = output.num_output_tokens

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def usage_of(states: Sequence[ChoiceState], n: int, with_reasoning: bool = False
             ) -> dict[str, Any]:
    """Completion tokens over all choices; each prompt's tokens once (from its first choice).
    `with_reasoning`: the family reasons, so usage says how many completion tokens did."""
    firsts = states[::n]
    return usage(
        num_prompt_tokens=sum(s.num_prompt_tokens for s in firsts),
        num_completion_tokens=sum(s.num_output_tokens for s in states),
        num_cached_tokens=sum(s.num_cached_tokens for s in firsts),
        num_reasoning_tokens=(sum(s.num_reasoning_tokens for s in states)
                              if with_reasoning else None),
    )


def prompt_usage_headers(fanout: FanOut, n: int) -> dict[str, str]:
    """A stream's usage headers (contracts/usage_headers.py) from each prompt's first
    choice's first output (every choice has yielded once when the stream opens)."""
    firsts = [output for index, output in fanout.first_outputs.items() if index % n == 0]
    return {PROMPT_TOKENS_HEADER: str(sum(o.num_prompt_tokens for o in firsts)),
            CACHED_TOKENS_HEADER: str(sum(o.num_cached_tokens for o in firsts))}
