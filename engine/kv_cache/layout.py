"""KVCacheLayout: which KV cache group each attention layer belongs to, and what memory that takes.

A group is a set of layers with one attention kind (full, sliding window W, or Llama 4's chunked
local attention of chunk C) that share one block
table per request; each group's blocks come from the one block pool. Layers of different groups
share the KV tensors: tensor slot j holds layer j of every group, so a block id is one block of
`num_tensor_slots` layers, whichever group holds it. Full groups keep a block per `block_size`
tokens of the context; window groups only the blocks the next token can still see
(engine/kv_cache/manager.py).

    gpt-oss-20b (24 layers, 12 sliding W=128, 12 full):   slots 12
        group 0  full        layers 1, 3, ..., 23      -> tensor slot 0..11
        group 1  window 128  layers 0, 2, ..., 22      -> tensor slot 0..11

Grouping (as vLLM's hybrid allocator): every group has `num_tensor_slots` = the smallest per-kind
layer count; a kind with more layers is split into several groups (the last one padded: its missing
layers' slots go unused). Full groups come first, so group 0 is full whenever any layer is. A window
at least `max_model_len` never binds: such layers count as full (their attention still gets the
window); so does a chunk at least `max_model_len`.

KV bytes (`kv_bytes_per_sequence`), with e = 2 * num_kv_heads * head_dim * element_size per layer
and token (K and V), a sequence of n tokens whose last c are being computed (c = 1 when decoding):

    full attention               num_layers * n * e
    this layout                  slots * e * block_size * (sum over groups of the blocks it keeps)
        full group keeps         ceil(n / block_size)
        window group keeps       ceil(n / block_size) - floor(max(0, n - c - W + 1) / block_size)
        chunk group keeps        ceil(n / block_size) - floor(floor((n - c) / C) * C / block_size)

gpt-oss-20b, bf16 KV, block_size 16, n = 32,768 decoding: 1,536 MiB full vs 771 MiB (12 layers of
32,768 tokens + 12 layers of 128); gpt-oss-120b: 2,304 MiB vs 1,156.5 MiB.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from engine.config import ModelConfig


@dataclass(frozen=True)
class KVCacheGroup:
    layers: tuple[int, ...]  # decoder layers in this group, in order (slot j = layers[j])
    sliding_window: int | None  # None: full attention (or chunked, when attention_chunk is set)
    attention_chunk: int | None = None  # C: a token at p sees floor(p / C) * C .. p (Llama 4)

    @property
    def is_full(self) -> bool:
        return self.sliding_window is None and self.attention_chunk is None

    def first_visible_position(self, position: int) -> int:
        """The first position a token at `position` (or any later one) attends to in this group."""
        if self.sliding_window is not None:
            return max(0, position - self.sliding_window + 1)
        if self.attention_chunk is not None:
            return position // self.attention_chunk * self.attention_chunk
        return 0


@dataclass(frozen=True)
class KVCacheLayout:
    num_layers: int
    groups: tuple[KVCacheGroup, ...]

    def __post_init__(self) -> None:
        seen = sorted(layer for g in self.groups for layer in g.layers)
        if seen != list(range(self.num_layers)):
            raise ValueError(f"every layer must be in exactly one group, got {seen}")
        if any(len(g.layers) > self.num_tensor_slots for g in self.groups):
            raise ValueError("a group has more layers than tensor slots")

    @classmethod
    def for_model(cls, config: ModelConfig, max_model_len: int) -> KVCacheLayout:
        by_kind: dict[tuple[int | None, int | None], list[int]] = {}  # (window, chunk) -> layers
        for layer in range(config.num_layers):
            window, chunk = config.layer_sliding_window(layer), config.layer_attention_chunk(layer)
            kind = (None if window is None or window >= max_model_len else window,
                    None if chunk is None or chunk >= max_model_len else chunk)
            by_kind.setdefault(kind, []).append(layer)
        slots = min(len(layers) for layers in by_kind.values())
        # full first, then windows, then chunks, each by size
        kinds = sorted(by_kind,
                       key=lambda k: (k != (None, None), k[1] is not None, k[0] or 0, k[1] or 0))
        groups = tuple(KVCacheGroup(tuple(by_kind[k][i:i + slots]), *k)
                       for k in kinds for i in range(0, len(by_kind[k]), slots))
        return cls(config.num_layers, groups)

    @classmethod
    def full_attention(cls, num_layers: int) -> KVCacheLayout:
        return cls(num_layers, (KVCacheGroup(tuple(range(num_layers)), None),))

    @cached_property
    def num_tensor_slots(self) -> int:
        return max(len(g.layers) for g in self.groups)

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        return tuple(g.sliding_window for g in self.groups)

    @property
    def group_chunks(self) -> tuple[int | None, ...]:
        return tuple(g.attention_chunk for g in self.groups)

    @cached_property
    def layer_group(self) -> tuple[int, ...]:
        """layer -> its group's index."""
        owner = {layer: i for i, g in enumerate(self.groups) for layer in g.layers}
        return tuple(owner[layer] for layer in range(self.num_layers))

    @cached_property
    def layer_slot(self) -> tuple[int, ...]:
        """layer -> the KV tensor slot it reads and writes."""
        slot = {layer: j for g in self.groups for j, layer in enumerate(g.layers)}
        return tuple(slot[layer] for layer in range(self.num_layers))


def kv_bytes_per_token(config: ModelConfig, element_size: int) -> int:
    """K and V of one token in one layer, in bytes (MLA: one latent vector, K and V shared)."""
    return (1 if config.kv_is_shared else 2) * config.num_kv_heads * config.head_dim * element_size


def kv_bytes_per_sequence(layout: KVCacheLayout, config: ModelConfig, num_tokens: int,
                          block_size: int, element_size: int, chunk_tokens: int = 1) -> int:
    """Bytes of KV one sequence of `num_tokens` holds with this layout (whole blocks, every slot of
    a block counted), while a step of `chunk_tokens` new tokens runs (1: decoding)."""
    per_block = layout.num_tensor_slots * block_size * kv_bytes_per_token(config, element_size)
    num_blocks = 0
    for group in layout.groups:
        full = -(-num_tokens // block_size)
        first_needed = group.first_visible_position(max(0, num_tokens - chunk_tokens)) // block_size
        num_blocks += full - first_needed
    return num_blocks * per_block
