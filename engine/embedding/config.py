"""Frozen configs of the embedding path: the encoder's architecture and how it pools, and how
the embedder batches requests.

    EncoderConfig    config.json (BertModel) + the sentence-transformers files beside it
                     (modules.json, 1_Pooling/config.json, sentence_bert_config.json)
    EmbedderConfig   the batch bounds (tokens incl. padding, inputs) of one forward pass
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Pooling = Literal["mean", "cls"]


@dataclass(frozen=True)
class EncoderConfig:
    """A BERT-style encoder (all-MiniLM, BGE, GTE: `BertModel`) and its sentence pipeline.

    `max_seq_length` is the longest input (special tokens included) the model embeds: the
    sentence-transformers `max_seq_length`, else `max_position_embeddings`. `pooling` turns the
    last hidden states into one vector ("mean" over the real tokens, or the "cls" token's);
    `normalize` scales it to unit L2 norm (a `Normalize` module in modules.json).
    """

    model_id: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int = 0
    max_seq_length: int = 512
    pooling: Pooling = "mean"
    normalize: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                     "max_position_embeddings", "max_seq_length"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads "
                             f"{self.num_heads}")
        if self.max_seq_length > self.max_position_embeddings:
            raise ValueError(f"max_seq_length {self.max_seq_length} is over "
                             f"max_position_embeddings {self.max_position_embeddings}")
        if self.pooling not in ("mean", "cls"):
            raise ValueError(f"unsupported pooling {self.pooling!r} (mean or cls)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def dimensions(self) -> int:
        """The length of one embedding vector."""
        return self.hidden_size


@dataclass(frozen=True)
class EmbedderConfig:
    """One forward pass holds at most `max_num_batched_tokens` tokens (packed; its attention's
    padded rows, inputs x the longest input, at most twice that) and at most `max_num_inputs`
    inputs; inputs of several requests share a pass. What waits is bounded in bytes:
    `max_num_queued_tokens` token ids (int32, 4 bytes each: 4 MiB) and `max_num_queued_inputs`
    inputs, each of which holds its output vector (hidden_size float32s: 1.5 KiB for MiniLM, 24 MiB
    in all); more is refused (EmbedderBusy, a 503)."""

    max_num_batched_tokens: int = 8192
    max_num_inputs: int = 256
    max_num_queued_inputs: int = 16384
    max_num_queued_tokens: int = 1 << 20

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_inputs", "max_num_queued_inputs",
                     "max_num_queued_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)}")
