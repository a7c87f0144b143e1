"""Paged attention for mixed prefill + decode batches, and the per-step attention context.

Dimension legend: T tokens in the step, H query heads, G kv heads (grouped-query), Dh head dim,
D decode sequences (one new token each), L longest decode context, C a prefill sequence's context.

The runner builds one `AttentionMetadata` per step and enters `forward_context(metadata)`; attention layers
read it with `current_metadata()`. Nesting is rejected, so a stale context can never leak into a step.
Token order inside a step: the D decode tokens first, then each prefill chunk's tokens.

Backends (swappable behind the ABC below): `TorchPagedAttention` (CPU; engine/layers/torch_attention.py)
and, on CUDA, the Triton kernels of engine/kernels (engine/layers/triton_attention.py).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefillSegment:
    query_start: int  # rows [query_start, query_end) of the step's tokens
    query_end: int
    context_blocks: torch.Tensor  # [ceil(C / block_size)] int64 blocks of the whole context
    context_len: int  # C: cached prefix + this chunk
    num_cached_tokens: int  # context before this chunk: causal, aligned to the lower right


@dataclass(frozen=True)
class CascadeGroup:
    """Decode rows [row_start, row_end) whose sequences share their first blocks (one prompt prefix).

    The shared prefix's K/V is read once for all of them; each suffix separately; the two partial
    softmaxes are merged with their log-sum-exp (cascade attention).
    """

    row_start: int
    row_end: int
    prefix_blocks: torch.Tensor  # [P / block_size] int64 (the prefix is whole blocks)
    suffix_blocks: torch.Tensor  # [n, W] int64, padded with block 0
    suffix_len: int  # S: positions of the gathered suffix to use
    suffix_mask: torch.Tensor | None  # [n, 1, 1, S] additive (0 / -inf); None when nothing is padded


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V goes (block_id * block_size + offset)
    num_decode_tokens: int  # every decode row: the plain ones, then the cascade groups' rows
    decode_blocks: torch.Tensor | None  # [D_plain, W] int64 context blocks, padded with block 0
    decode_len: int  # L: positions of the gathered context to use
    decode_mask: torch.Tensor | None  # [D_plain, 1, 1, L] additive (0 / -inf); None when nothing is padded
    prefills: tuple[PrefillSegment, ...]
    cascade_groups: tuple[CascadeGroup, ...] = ()
    max_query_len: int = 0  # host-side maxima, so kernel launchers need no device sync
    max_seq_len: int = 0
    # Raw per-sequence tensors for kernel backends (Triton): decode seqs first, then prefill seqs.
    cu_query_lens: torch.Tensor | None = None  # [S+1] int32
    seq_lens: torch.Tensor | None = None  # [S] int32
    block_tables: torch.Tensor | None = None  # [S, max_blocks] int32


_current: AttentionMetadata | None = None


@contextlib.contextmanager
def forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    global _current
    if _current is not None:
        raise RuntimeError("forward_context does not nest: a step is already running")
    _current = metadata
    try:
        yield
    finally:
        _current = None


def current_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention called outside forward_context")
    return _current


class PagedAttentionBackend(abc.ABC):
    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, scale: float, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, Dh], k/v [T, G, Dh] (new tokens) -> [T, H, Dh]. Writes k/v into the caches
        ([num_blocks, block_size, G, Dh]) at meta.slot_mapping first, then attends over each context."""


def build_attention_backend(name: str) -> PagedAttentionBackend:
    if name == "torch":
        from engine.layers.torch_attention import TorchPagedAttention

        return TorchPagedAttention()
    if name == "triton":
        from engine.layers.triton_attention import TritonPagedAttention

        return TritonPagedAttention()
    raise ValueError(f"unknown attention backend {name!r}")
