"""BERT-style encoders (`BertModel`: all-MiniLM, BGE, GTE): token ids -> last hidden states.

Dimensions:  B inputs in the pass, T the longest input's tokens (the others padded),
             C hidden_size, H num_heads, D head_dim (C = H * D), F intermediate_size.

    x = LN(word[ids] + position[0..T) + token_type[0])            [B, T, C]
    per layer:  x = LN(x + attn(x) @ Wo)                           post-norm, as BERT
                x = LN(x + act(x @ W1) @ W2)

Attention is bidirectional; a padded position is masked as a key, so a real token's state does
not depend on how much padding its pass has (the pooling ignores padded queries). The pooler
(`pooler.dense`, BERT's next-sentence head) is not used by sentence embeddings: its tensors are
read and dropped. No KV cache: every pass is a whole prompt.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.embedding.config import EncoderConfig
from engine.models.weights import Weights, check_all_used, take, take_optional

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,  # erf, as transformers' "gelu"
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class _Linear:
    __slots__ = ("bias", "weight")

    def __init__(self, weights: Weights, name: str, out_features: int, in_features: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.weight = take(weights, f"{name}.weight", (out_features, in_features)).to(device, dtype)
        self.bias = take(weights, f"{name}.bias", (out_features,)).to(device, dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _LayerNorm:
    __slots__ = ("bias", "eps", "weight")

    def __init__(self, weights: Weights, name: str, size: int, eps: float, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.weight = take(weights, f"{name}.weight", (size,)).to(device, dtype)
        self.bias = take(weights, f"{name}.bias", (size,)).to(device, dtype)
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class _EncoderLayer:
    def __init__(self, config: EncoderConfig, weights: Weights, i: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        c, f, eps = config.hidden_size, config.intermediate_size, config.layer_norm_eps
        p = f"encoder.layer.{i}"
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.query = _Linear(weights, f"{p}.attention.self.query", c, c, device, dtype)
        self.key = _Linear(weights, f"{p}.attention.self.key", c, c, device, dtype)
        self.value = _Linear(weights, f"{p}.attention.self.value", c, c, device, dtype)
        self.attn_out = _Linear(weights, f"{p}.attention.output.dense", c, c, device, dtype)
        self.attn_norm = _LayerNorm(weights, f"{p}.attention.output.LayerNorm", c, eps, device, dtype)
        self.up = _Linear(weights, f"{p}.intermediate.dense", f, c, device, dtype)
        self.down = _Linear(weights, f"{p}.output.dense", c, f, device, dtype)
        self.mlp_norm = _LayerNorm(weights, f"{p}.output.LayerNorm", c, eps, device, dtype)
        self.act = ACTIVATIONS[config.hidden_act]

    def __call__(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]

        attn = F.scaled_dot_product_attention(heads(self.query(x)), heads(self.key(x)),
                                              heads(self.value(x)), attn_mask=key_mask)
        attn = attn.transpose(1, 2).reshape(b, t, c)  # [B, H, T, D] -> [B, T, C]
        x = self.attn_norm(x + self.attn_out(attn))
        return self.mlp_norm(x + self.down(self.act(self.up(x))))


class BertEncoder:
    """`forward(input_ids, lengths)` -> last hidden states [B, T, C] (padded rows: garbage)."""

    def __init__(self, config: EncoderConfig, weights: Weights, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> None:
        c = config.hidden_size
        self.config, self.device, self.dtype = config, device, dtype
        self.word = take(weights, "embeddings.word_embeddings.weight",
                         (config.vocab_size, c)).to(device, dtype)
        self.position = take(weights, "embeddings.position_embeddings.weight",
                             (config.max_position_embeddings, c)).to(device, dtype)
        token_type = take(weights, "embeddings.token_type_embeddings.weight",
                          (config.type_vocab_size, c))
        self.token_type0 = token_type[0].to(device, dtype)  # single-segment inputs only
        self.norm = _LayerNorm(weights, "embeddings.LayerNorm", c, config.layer_norm_eps, device,
                               dtype)
        self.layers = [_EncoderLayer(config, weights, i, device, dtype)
                       for i in range(config.num_layers)]
        take_optional(weights, "embeddings.position_ids", None)  # a buffer: 0..max_pos
        take_optional(weights, "pooler.dense.weight", (c, c))
        take_optional(weights, "pooler.dense.bias", (c,))
        check_all_used(weights, "bert")

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """`input_ids` [B, T] (padded with anything), `lengths` [B] (each >= 1, <= T)."""
        b, t = input_ids.shape
        positions = torch.arange(t, device=self.device)
        valid = positions[None, :] < lengths[:, None]  # [B, T]
        x = self.word[input_ids] + self.position[:t] + self.token_type0  # [B, T, C]
        x = self.norm(x)
        key_mask = valid[:, None, None, :]  # [B, 1, 1, T]: attend to real tokens only
        for layer in self.layers:
            x = layer(x, key_mask)
        return x
