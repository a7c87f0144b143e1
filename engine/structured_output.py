"""Structured output: decoding constrained by a grammar, with llguidance. Two users: OpenAI's
`response_format` (a JSON object, or a JSON schema), and a forced tool call (`tool_choice`
"required" or a named function: the tool parser's format as a Lark grammar, chat/tool_parsers).

    spec = OutputGrammar.json_schema(schema)       # or .json_object(), .lark(); OutputGrammarError
    params = SamplingParams(..., grammar=spec)
    compiler = GrammarCompiler(tokenizer.backend, vocab_size, eos_token_ids)   # one per engine
    matcher = compiler.matcher(spec)                # one per request (a choice of n: its own),
                                                    # a copy of the spec's matcher built once
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

import threading
from collections.abc import Sequence
from typing import Any

import torch

from contracts import output_grammar
from contracts.output_grammar import OutputGrammar, OutputGrammarError
from infra.byte_lru import ByteLRU, str_bytes


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
    is made on the first constrained request, so engines that never see one never pay for it.

    Building a matcher builds its lexer against the vocabulary (~40 ms for a forced choice
    among 40 tools): each grammar is built once, by `prepare` in the server's worker thread
    (or, for a caller that did not prepare, in the engine thread, where it stalls every running
    request), and each request (each choice of n) gets a copy of that fresh matcher.

    Built matchers are cached per (cache salt, grammar): a tenant whose grammar is already built
    is answered ~40 ms sooner, so one tenant's traffic must not warm another's. The cache is
    bounded by an estimate of its bytes, not by a count: a matcher grows with its grammar (a
    forced choice among many large tool schemas)."""

    MAX_CACHED_GRAMMAR_BYTES = 64 * 1024 * 1024
    # A built matcher's estimated bytes: a fixed part plus a part per byte of llguidance grammar,
    # above the RSS growth measured per built matcher with SmolLM2's 49k vocabulary (JSON schemas
    # of 2-400 properties: 0-1.7 MiB a matcher, 7-64 bytes per grammar byte).
    MATCHER_BASE_BYTES = 256 * 1024
    MATCHER_BYTES_PER_GRAMMAR_BYTE = 64

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._backend = tokenizer  # a `tokenizers.Tokenizer`
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's vocabulary)
        self._eos_token_ids = list(eos_token_ids)
        self._tokenizer: Any = None
        self._fresh: ByteLRU[tuple[str, OutputGrammar], Any] = ByteLRU(  # (salt, spec) -> LLMatcher
            self.MAX_CACHED_GRAMMAR_BYTES)
        self._lock = threading.Lock()  # guards _fresh (the server's threads and the engine's)
        self._tokenizer_lock = threading.Lock()

    @property
    def num_words(self) -> int:
        """int32 words of a bitmask row: one bit per token of the logits, rounded up."""
        return (self.vocab_size + 31) // 32

    def prepare(self, spec: OutputGrammar, cache_salt: str | None = None) -> None:
        """Build `spec`'s matcher now, from any thread (the replica's server does it in a worker
        thread as it reads the request); OutputGrammarError when llguidance refuses it.
        `cache_salt`: the request's (its tenant's); a matcher is reused only under the same salt."""
        self._fresh_matcher(spec, cache_salt)

    def matcher(self, spec: OutputGrammar, cache_salt: str | None = None) -> GrammarMatcher:
        """A new parser state for `spec`; OutputGrammarError when llguidance refuses it."""
        return GrammarMatcher(self._fresh_matcher(spec, cache_salt).deep_copy(), self.num_words)

    @property
    def num_cached_bytes(self) -> int:
        """The estimated bytes of the cached matchers (at most `MAX_CACHED_GRAMMAR_BYTES`)."""
        return self._fresh.num_bytes

    def _fresh_matcher(self, spec: OutputGrammar, cache_salt: str | None) -> Any:
        key = (cache_salt or "", spec)
        with self._lock:
            fresh = self._fresh.get(key)
        if fresh is not None:
            return fresh
        fresh = self._build(spec)  # outside the lock: slow, and llguidance releases the GIL
        num_bytes = (self.MATCHER_BASE_BYTES + str_bytes(key[0])
                     + self.MATCHER_BYTES_PER_GRAMMAR_BYTE * len(output_grammar.grammar_of(spec)))
        with self._lock:
            self._fresh.put(key, fresh, num_bytes)
        return fresh

    def _build(self, spec: OutputGrammar) -> Any:
        import llguidance

        with self._tokenizer_lock:  # built once, by whichever thread needs it first
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self._backend.to_str(), n_vocab=self.vocab_size,
                    eos_token=self._eos_token_ids or None)
        matcher = llguidance.LLMatcher(self._tokenizer, output_grammar.grammar_of(spec),
                                       log_level=0)
        if matcher.is_error():
            raise OutputGrammarError(f"output grammar: {matcher.get_error()}")
        return matcher


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [n, num_words] -> bool [n, vocab_size]: True where the token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = (bitmask[:, :, None] >> shifts) & 1  # [n, num_words, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()  # [n, vocab_size]
