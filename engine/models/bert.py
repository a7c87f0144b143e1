"""BERT-style encoders (`BertModel`: all-MiniLM, BGE, GTE): token ids -> last hidden states.

Dimensions:  N tokens of the pass (its inputs packed end to end, no padding), B inputs,
             T the longest input's tokens, C hidden_size, H num_heads, D head_dim (C = H * D),
             F intermediate_size.

    x = LN(word[ids] + position[p] + token_type[0])               [N, C]   p: within its input
    per layer:  x = LN(x + attn(x) @ Wo)                           post-norm, as BERT
                x = LN(x + act(x @ W1) @ W2)

Packed: every linear layer (q, k and v fused into one), norm and activation runs on the N real
tokens only; attention alone scatters q/k/v into a padded [B, H, T, D] (`flat`: each token's
row in it), masks padded keys, and gathers the real rows back. So a pass costs its real tokens
plus the attention's padding, and a token's state does not depend on which inputs share it. The
pooler (`pooler.dense`, BERT's next-sentence head) is not used by sentence embeddings: its tensors
are read and dropped. No KV cache: every pass is a whole prompt.
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

    @classmethod
    def fused(cls, parts: tuple[_Linear, ...]) -> _Linear:
        """One linear whose output is the parts' outputs side by side."""
        fused = cls.__new__(cls)
        fused.weight = torch.cat([part.weight for part in parts])
        fused.bias = torch.cat([part.bias for part in parts])
        return fused


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
        q, k, v = (_Linear(weights, f"{p}.attention.self.{name}", c, c, device, dtype)
                   for name in ("query", "key", "value"))
        self.qkv = _Linear.fused((q, k, v))  # one [3C, C] matmul instead of three
        self.attn_out = _Linear(weights, f"{p}.attention.output.dense", c, c, device, dtype)
        self.attn_norm = _LayerNorm(weights, f"{p}.attention.output.LayerNorm", c, eps, device,
                                    dtype)
        self.up = _Linear(weights, f"{p}.intermediate.dense", f, c, device, dtype)
        self.down = _Linear(weights, f"{p}.output.dense", c, f, device, dtype)
        self.mlp_norm = _LayerNorm(weights, f"{p}.output.LayerNorm", c, eps, device, dtype)
        self.act = ACTIVATIONS[config.hidden_act]

    def __call__(self, x: torch.Tensor, layout: _Layout) -> torch.Tensor:
        n, c = x.shape
        b, t = layout.key_mask.shape[0], layout.key_mask.shape[-1]
        qkv = self.qkv(x)  # [N, 3C]
        padded = qkv.new_zeros(b * t, 3 * c).index_copy_(0, layout.flat, qkv)  # [B*T, 3C]
        q, k, v = padded.view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.key_mask)  # [B, H, T, D]
        attn = attn.transpose(1, 2).reshape(b * t, c)[layout.flat]  # [B, H, T, D] -> [N, C]
        x = self.attn_norm(x + self.attn_out(attn))
        return self.mlp_norm(x + self.down(self.act(self.up(x))))


class _Layout:
    """Where the packed tokens sit: `flat` [N] each token's row in a padded [B * T], `key_mask`
    [B, 1, 1, T] the real keys, `positions` [N] each token's position within its input."""

    __slots__ = ("flat", "key_mask", "positions")

    def __init__(self, lengths: torch.Tensor) -> None:
        b, t = lengths.shape[0], int(lengths.max())
        starts = torch.cumsum(lengths, 0) - lengths  # [B]
        rows = torch.repeat_interleave(torch.arange(b, device=lengths.device), lengths)  # [N]
        self.positions = torch.arange(rows.shape[0], device=lengths.device) - starts[rows]
        self.flat = rows * t + self.positions
        valid = torch.arange(t, device=lengths.device)[None, :] < lengths[:, None]  # [B, T]
        self.key_mask = valid[:, None, None, :]


class BertEncoder:
    """`forward(input_ids, lengths)` -> last hidden states [N, C] of the packed tokens."""

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
        """`input_ids` [N]: the inputs end to end; `lengths` [B] (each >= 1, summing to N)."""
        layout = _Layout(lengths)
        x = self.norm(self.word[input_ids] + self.position[layout.positions]
                      + self.token_type0)  # [N, C]
        for layer in self.layers:
            x = layer(x, layout)
        return x
