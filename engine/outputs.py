"""What the engine hands back per request and step: plain data, no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class FinishReason(StrEnum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # client went away, or the request was cancelled


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first


@dataclass
class RequestOutput:
    """One step's news for one request: the tokens and text added since the last output.

    `text` already has stop strings removed (and text held back while a stop string might
    still be forming is released only once it cannot be one). The last output of a request
    has `finish_reason` set; the counters are totals so far.
    """

    request_id: str
    new_token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: list[TokenLogprob] | None = None
    # on the request's first output, when asked: prompt tokens 1.. (the first has no logprob)
    prompt_logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    # queue/prefill/decode seconds at finish
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class PromptTooLongError(ValueError):
    """The prompt (plus at least one new token) can never fit the context window or the KV cache."""

    def __init__(self, num_prompt_tokens: int, limit: int, what: str = "context window") -> None:
        super().__init__(
            f"This model's maximum {what} is {limit} tokens; the prompt has {num_prompt_tokens} "
            "tokens and at least one more is needed for the completion."
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.limit = limit
