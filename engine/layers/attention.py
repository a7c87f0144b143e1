"""Paged attention for mixed prefill + decode batches, and the per-step attention context.

Dimension legend: T tokens in the step, H query heads, G kv heads (grouped-query), Dh head dim,
D decode sequences (one new token each), L longest decode context, C a prefill sequence's context.

The runner builds one `AttentionMetadata` per KV cache group and step, and enters
`forward_context(metadata, per_layer)`; layer i's attention reads its group's with
`layer_metadata(i)` (block tables and slots differ between groups), step-level facts (token counts)
come from `current_metadata()`. Nesting is rejected, so a stale context can never leak into a
step. Token order inside a step is the same in every group: the D decode tokens first, then each
prefill chunk's tokens.

Attention variants (keyword arguments of `PagedAttentionBackend.forward`):

    sliding_window W   a query at position p sees keys at positions p-W+1 .. p (W keys, itself
                       included), as transformers' sliding_window_causal mask (kv_idx > q_idx - W)
    attention_chunk C  chunked local attention (Llama 4's RoPE layers): a query at position p sees
                       keys at floor(p / C) * C .. p, its own chunk only (transformers'
                       chunked_causal mask: kv_idx // C == q_idx // C)
    sinks [H]          one learned logit per query head that joins each softmax denominator and
                       carries no value (gpt-oss): out = sum_j e^s_j v_j / (sum_j e^s_j + e^sink)

The metadata may hold fewer leading blocks than a context has (a window group's table starts at its
first live block): `PrefillSegment.context_start` and `decode_first_positions` say which position
the first gathered block starts at, so a backend masks by absolute positions whatever was gathered.

Backends (swappable behind the ABC below): `TorchPagedAttention` (CPU;
engine/layers/torch_attention.py) and, on CUDA, the Triton kernels of engine/kernels
(engine/layers/triton_attention.py).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefillSegment:
    query_start: int  # rows [query_start, query_end) of the step's tokens
    query_end: int
    context_blocks: torch.Tensor  # [ceil(C / block_size)] int64 blocks of the whole context
    context_len: int  # C: cached prefix + this chunk
    num_cached_tokens: int  # context before this chunk: causal, aligned to the lower right
    context_start: int = 0  # position of context_blocks[0]'s first slot (block aligned)


@dataclass(frozen=True)
class CascadeGroup:
    """Decode rows [row_start, row_end) whose sequences share their first blocks (one prompt
    prefix).

    The shared prefix's K/V is read once for all of them; each suffix separately; the two partial
    softmaxes are merged with their log-sum-exp (cascade attention).
    """

    row_start: int
    row_end: int
    prefix_blocks: torch.Tensor  # [P / block_size] int64 (the prefix is whole blocks)
    suffix_blocks: torch.Tensor  # [n, W] int64, padded with block 0
    suffix_len: int  # S: positions of the gathered suffix to use
    # [n, 1, 1, S] additive (0 / -inf); None when nothing is padded
    suffix_mask: torch.Tensor | None


@dataclass(frozen=True)
class AttentionMetadata:
    # [T] int64: where each new token's K/V goes (block_id * block_size + offset)
    slot_mapping: torch.Tensor
    num_decode_tokens: int  # every decode row: the plain ones, then the cascade groups' rows
    decode_blocks: torch.Tensor | None  # [D_plain, W] int64 context blocks, padded with block 0
    decode_len: int  # L: positions of the gathered context to use
    # [D_plain, 1, 1, L] additive (0 / -inf); None when nothing is padded
    decode_mask: torch.Tensor | None
    prefills: tuple[PrefillSegment, ...]
    cascade_groups: tuple[CascadeGroup, ...] = ()
    max_query_len: int = 0  # host-side maxima, so kernel launchers need no device sync
    max_seq_len: int = 0
    # Raw per-sequence tensors for kernel backends (Triton): decode seqs first, then prefill seqs.
    cu_query_lens: torch.Tensor | None = None  # [S+1] int32
    seq_lens: torch.Tensor | None = None  # [S] int32
    block_tables: torch.Tensor | None = None  # [S, max_blocks] int32
    # Plain decode rows, for windows and sinks: each row's context length (its own token included)
    # and the position of its decode_blocks[i, 0] (None: 0, the table starts at the context's
    # start).
    decode_context_lens: torch.Tensor | None = None  # [D_plain] int64
    decode_first_positions: torch.Tensor | None = None  # [D_plain] int64, block aligned


_current: AttentionMetadata | None = None
_per_layer: Sequence[AttentionMetadata] | None = None


@contextlib.contextmanager
def forward_context(metadata: AttentionMetadata,
                    per_layer: Sequence[AttentionMetadata] | None = None) -> Iterator[None]:
    """Set the step's attention context. `per_layer[i]`: layer i's group metadata (None: every
    layer uses `metadata`, the single-group case)."""
    global _current, _per_layer
    if _current is not None:
        raise RuntimeError("forward_context does not nest: a step is already running")
    _current, _per_layer = metadata, per_layer
    try:
        yield
    finally:
        _current, _per_layer = None, None


def current_metadata() -> AttentionMetadata:
    """The step's metadata (its first KV cache group): for step-level facts such as token counts."""
    if _current is None:
        raise RuntimeError("attention called outside forward_context")
    return _current


def layer_metadata(layer: int) -> AttentionMetadata:
    """Layer `layer`'s metadata: its KV cache group's block tables and slots. Attention calls use
    this."""
    if _current is None:
        raise RuntimeError("attention called outside forward_context")
    return _current if _per_layer is None else _per_layer[layer]


class PagedAttentionBackend(abc.ABC):
    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, scale: float, meta: AttentionMetadata, *,
                sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                attention_chunk: int | None = None) -> torch.Tensor:
        """q [T, H, Dh], k/v [T, G, Dh] (new tokens) -> [T, H, Dh]. Writes k/v into the caches
        ([num_blocks, block_size, G, Dh]) at meta.slot_mapping first, then attends over each
        context.

        sliding_window: W >= 1, each query sees its W latest positions (None: the whole context).
        sinks: [H] float logits, one per query head, added to every softmax denominator (None:
        none). attention_chunk: C >= 1, each query sees its own chunk of C positions only (None: no
        chunks). Pass `meta = layer_metadata(layer)`: a window layer's group has its own block
        tables."""


def build_attention_backend(name: str) -> PagedAttentionBackend:
    if name == "torch":
        from engine.layers.torch_attention import TorchPagedAttention

        return TorchPagedAttention()
    if name == "triton":
        from engine.layers.triton_attention import TritonPagedAttention

        return TritonPagedAttention()
    raise ValueError(f"unknown attention backend {name!r}")
