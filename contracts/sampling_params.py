"""SamplingParams: how one request samples, with OpenAI semantics (+ vLLM's common extensions)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from contracts.output_grammar import OutputGrammar


# A temperature below this samples greedily (vLLM's _SAMPLING_EPS): dividing float32 logits by
# a tinier one (5e-324 is a valid JSON temperature) overflows them to inf, the softmax of inf is
# NaN, and inverse-CDF sampling over NaN returns the out-of-vocabulary id `vocab_size`.
GREEDY_TEMPERATURE_BELOW = 1e-5
# At most this many UTF-8 bytes in one stop string (a few hundred characters: a closing tag, a
# delimiter line), at the gateway and the replica alike. OpenAI bounds only their count; here the
# matcher holds back and rescans up to the longest stop string's length of text per token.
MAX_STOP_BYTES = 512
# At most this many stop token ids (vLLM's extension; each generated token is looked up in them).
MAX_STOP_TOKEN_IDS = 256


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message is safe to show to the client, and
    `param` names the request field when one is at fault (OpenAI's error `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 (or below GREEDY_TEMPERATURE_BELOW) = greedy
    top_p: float = 1.0
    top_k: int | None = None  # None = no top-k
    seed: int | None = None
    max_tokens: int | None = None  # None: up to the context window
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None  # each prompt token's logprob + this many alternatives
    n: int = 1
    grammar: OutputGrammar | None = None  # structured output (engine/structured_output.py)

    def __post_init__(self) -> None:
        checks = [  # (ok, the field at fault, message)
            (0.0 <= self.temperature <= 2.0, "temperature", "temperature must be between 0 and 2"),
            (0.0 < self.top_p <= 1.0, "top_p", "top_p must be in (0, 1]"),
            (self.top_k is None or self.top_k >= 1, "top_k", "top_k must be >= 1"),
            (self.max_tokens is None or self.max_tokens >= 1
             or (self.max_tokens == 0 and self.prompt_logprobs is not None), "max_tokens",
             "max_tokens must be >= 1 (0 only to score a prompt: with prompt_logprobs)"),
            (self.min_tokens >= 0, "min_tokens", "min_tokens must be >= 0"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             "min_tokens must not exceed max_tokens"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
             "presence_penalty must be between -2 and 2"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
             "frequency_penalty must be between -2 and 2"),
            (0 <= self.top_logprobs <= 20, "top_logprobs", "top_logprobs must be between 0 and 20"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
             "prompt_logprobs must be between 0 and 20"),
            (1 <= self.n <= 16, "n", "n must be between 1 and 16"),
            (self.seed is None or -(1 << 63) <= self.seed < 1 << 63, "seed",
             "seed must be a signed 64-bit integer"),
            (len(self.stop) <= 16, "stop", "at most 16 stop sequences"),
            (all(isinstance(s, str) and s for s in self.stop), "stop",
             "stop sequences must be non-empty strings"),
            (all(len(s.encode()) <= MAX_STOP_BYTES for s in self.stop), "stop",
             f"each stop sequence must be at most {MAX_STOP_BYTES} bytes (UTF-8)"),
            (len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
             f"at most {MAX_STOP_TOKEN_IDS} stop token ids"),
            (all(i >= 0 for i in self.stop_token_ids), "stop_token_ids",
             "stop token ids must be >= 0"),
            # min_tokens blocks the end-of-sequence a complete grammar allows alone: no token left
            (self.grammar is None or self.min_tokens == 0, "min_tokens",
             "min_tokens cannot be combined with a JSON response_format"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise SamplingParamsError(message, param)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_BELOW

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
