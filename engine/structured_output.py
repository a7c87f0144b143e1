"""Structured output: decoding constrained by a grammar (OpenAI's `response_format`), with llguidance.

    spec = OutputGrammar.json_schema(schema)       # or .json_object(); checked: OutputGrammarError
    params = SamplingParams(..., grammar=spec)
    compiler = GrammarCompiler(tokenizer.backend, vocab_size, eos_token_ids)   # one per engine
    matcher = compiler.matcher(spec)                # one per request (a choice of n: its own)
    each step:  matcher.fill_bitmask(row)           # int32 [num_words]: bit t set = token t allowed
                sampler: disallowed logits -> -inf  # engine/sampler.py::apply_token_bitmasks
                matcher.accept(token_id)            # the sampled token moves the parser on
    finished:   the grammar is complete and only an end-of-sequence token is allowed, so the request
                stops as any request stops on EOS (`is_stopped()` covers `ignore_eos`)

The JSON is compact (no optional whitespace): small models given free whitespace tend to emit
newlines until max_tokens. A grammar constrains the tokens, not the length: an answer cut by
`max_tokens` ends with finish_reason "length" and is not valid JSON, as with OpenAI.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson
import torch

from engine.sampling_params import SamplingParamsError

GrammarKind = Literal["json_object", "json_schema"]
_JSON_OPTIONS = {"whitespace_flexible": False}


class OutputGrammarError(SamplingParamsError):
    """The requested output format cannot be compiled (the message is safe to show)."""


@dataclass(frozen=True)
class OutputGrammar:
    """What the output must match: `kind` and the JSON schema text (hashable: a compile cache key)."""

    kind: GrammarKind
    schema_json: str

    @classmethod
    def json_object(cls) -> OutputGrammar:
        return cls("json_object", '{"type":"object"}')

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> OutputGrammar:
        """Raises OutputGrammarError when llguidance cannot compile the schema."""
        spec = cls("json_schema", orjson.dumps(schema).decode())  # key order kept: it is the output order
        _grammar_of(spec)
        return spec


@functools.lru_cache(maxsize=256)
def _grammar_of(spec: OutputGrammar) -> str:
    """The llguidance grammar of `spec` (validated, cached by the schema text)."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(spec.schema_json,
                                                                defaults=_JSON_OPTIONS)
    except ValueError as exc:
        raise OutputGrammarError(f"response_format: invalid JSON schema: {exc}") from exc
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise OutputGrammarError(f"response_format: unsupported JSON schema: {'; '.join(messages)}")
    return grammar


class GrammarMatcher:
    """One sequence's parser state. Written by the engine thread only."""

    def __init__(self, matcher: Any, num_words: int) -> None:
        self._matcher = matcher  # llguidance.LLMatcher
        self.num_words = num_words  # int32 words of a bitmask row

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Writes the tokens allowed next into `row` (int32 [num_words], contiguous, CPU)."""
        assert row.dtype == torch.int32 and row.is_contiguous() and row.numel() == self.num_words
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def accept(self, token_id: int) -> bool:
        """Advances past the sampled token; False when the grammar refused it (then stopped)."""
        return bool(self._matcher.consume_token(token_id))

    def is_stopped(self) -> bool:
        """True once the grammar is complete and its end-of-sequence was taken (or it failed)."""
        return bool(self._matcher.is_stopped())


class GrammarCompiler:
    """Builds matchers for one tokenizer. The llguidance tokenizer (~0.3 s for a 49k vocabulary)
    is made on the first constrained request, so engines that never see one never pay for it."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._backend = tokenizer  # a `tokenizers.Tokenizer`
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's vocabulary)
        self._eos_token_ids = list(eos_token_ids)
        self._tokenizer: Any = None

    @property
    def num_words(self) -> int:
        """int32 words of a bitmask row: one bit per token of the logits, rounded up."""
        return (self.vocab_size + 31) // 32

    def matcher(self, spec: OutputGrammar) -> GrammarMatcher:
        import llguidance

        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(self._backend.to_str(), n_vocab=self.vocab_size,
                                                     eos_token=self._eos_token_ids or None)
        matcher = llguidance.LLMatcher(self._tokenizer, _grammar_of(spec), log_level=0)
        if matcher.is_error():
            raise OutputGrammarError(f"response_format: {matcher.get_error()}")
        return GrammarMatcher(matcher, self.num_words)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [n, num_words] -> bool [n, vocab_size]: True where the token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = (bitmask[:, :, None] >> shifts) & 1  # [n, num_words, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()  # [n, vocab_size]
