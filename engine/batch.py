"""ScheduledBatch: the scheduler -> runner hand-off. Plain ints and lists, no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ScheduledSequence:
    request_id: str
    token_ids: list[int]  # the tokens whose KV this step computes
    start_position: int  # position of token_ids[0] (= tokens already computed before this step)
    block_table: list[int | None]  # the blocks of KV cache group 0 (the only group of most models)
    needs_sample: bool  # the chunk reaches the request's last known token: sample a new one
    needs_prompt_logits: bool = False  # logits of every row (prompt logprobs), not just the last
    # Groups 1.. (engine/kv_cache/layout.py). In window groups, None: a block the window released.
    extra_block_tables: tuple[list[int | None], ...] = ()

    @property
    def block_tables(self) -> tuple[list[int | None], ...]:
        """One table per KV cache group, in group order."""
        return (self.block_table, *self.extra_block_tables)

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Context length after this step (computed + scheduled)."""
        return self.start_position + len(self.token_ids)


@dataclass
class ScheduledBatch:
    sequences: list[ScheduledSequence] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)

    @property
    def is_empty(self) -> bool:
        return not self.sequences
