"""What the server needs from the engine and its tokenizer (structural types).

The engine (engine/async_engine.py) satisfies `ServedEngine`; tests satisfy it with a fake.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Protocol

from contracts.output_grammar import OutputGrammar
from contracts.sampling_params import SamplingParams
from engine.config import ModelConfig
from engine.outputs import RequestOutput


class ServedTokenizer(Protocol):
    eos_token_ids: Sequence[int]
    max_token_bytes: int | None  # a text of B UTF-8 bytes has >= B / max_token_bytes tokens

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True,
                            continue_final_message: bool = False) -> str: ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False
                    ) -> list[int]: ...


class EngineStatsLike(Protocol):
    num_running_requests: int
    num_waiting_requests: int
    num_kv_blocks_total: int
    num_kv_blocks_used: int
    num_prefix_cache_queried_tokens: int
    num_prefix_cache_hit_tokens: int
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    num_preemptions_total: int


class ServedEngine(Protocol):
    model_config: ModelConfig
    tokenizer: ServedTokenizer
    replica_id: str
    max_model_len: int

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                 cache_salt: str | None = None, trace_headers: Mapping[str, str] | None = None,
                 retain_s: float = 0.0, retention_id: str | None = None, priority: int = 0
                 ) -> AsyncIterator[RequestOutput]:
        """Async generator; raises PromptTooLongError before the first yield; closing it aborts.
        `retain_s` / `retention_id`: KV retention after the request ends; `priority`: the
        scheduling class, lower first (LLMEngine.add_request)."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def prepare_grammar(self, grammar: OutputGrammar, cache_salt: str | None = None) -> None:
        """Build `grammar`'s parser ahead, from any thread (OutputGrammarError if refused), so
        adding the request later costs the engine thread only a copy; it is reused only by
        requests with the same `cache_salt` (a tenant's built grammars are its own)."""
        ...

    def stats(self) -> EngineStatsLike: ...

    async def reset_prefix_cache(self) -> bool: ...

    def kv_events_since(self, seq: int) -> dict[str, Any]: ...

    def kv_snapshot(self) -> dict[str, Any]: ...

