"""Request: one sequence's state inside the engine. Counters, token ids and derived properties; no
tensors.

Token layout of a request:

    |<------------- num_tokens ------------->|
    | prompt_token_ids | output_token_ids    |
    |<-- num_computed_tokens -->|            |   KV written for these positions
    |<- num_cached_tokens ->|                    of them, found in the prefix cache at admission
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from contracts.block_hash import hash_blocks
from contracts.sampling_params import SamplingParams
from engine.outputs import FinishReason, TokenLogprob
from engine.structured_output import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # back in the waiting queue; recomputes from its prefix cache hits
    FINISHED = enum.auto()


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # scheduling class, lower first (engine/scheduler.py): -1 priority, 0 default, 1 flex
    priority: int = 0

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at first admission: what usage reports
    # the hit found on arrival (admission's estimate, engine/admission.py)
    num_cached_tokens_predicted: int = 0
    num_host_cached_tokens: int = 0  # of them, restored from the host KV tier
    num_preemptions: int = 0
    num_prefill_chunks: int = 0  # steps that computed part of the prompt (recomputes included)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    block_hashes: list[int] = field(default_factory=list)  # of every full block so far
    generator: torch.Generator | None = None  # per-request RNG when params.seed is set
    grammar: GrammarMatcher | None = None  # parser state when params.grammar is set
    # params.prompt_logprobs: entry i is prompt token i+1's (the first token has none)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # Keep the prompt's cached blocks for retain_s seconds after finishing
    # (engine/kv_cache/retention.py); the same retention_key (per cache salt) supersedes; None: the
    # last block's hash (a later retention that extends this prefix supersedes it all the same).
    retain_s: float = 0.0
    retention_id: str | None = None

    @property
    def retention_key(self) -> tuple[str, str]:
        """(owner, session): the owner is the cache salt, whose share of the pool is bounded."""
        session = self.retention_id or (f"tail:{self.block_hashes[-1]}" if self.block_hashes
                                        else self.request_id)
        return (self.cache_salt or "", session)

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    # ---- derived ---------------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Every prompt position needs its logits: such a request computes its whole prompt
        (no prefix-cache hits), and each chunk returns all its rows' logits."""
        return self.params.prompt_logprobs is not None

    @property
    def max_num_tokens(self) -> int:
        """Prompt plus the most tokens it may generate, capped by the context window."""
        cap = self.max_model_len
        if self.params.max_tokens is not None:
            cap = min(cap, self.num_prompt_tokens + self.params.max_tokens)
        return cap

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def update_block_hashes(self, block_size: int, model_id: str) -> None:
        """Extend `block_hashes` over blocks that became full (incremental; cheap when none did)."""
        if self.num_tokens // block_size > len(self.block_hashes):
            self.block_hashes = hash_blocks(self.all_token_ids, block_size, model_id,
                                            self.cache_salt, parent_hashes=self.block_hashes)
