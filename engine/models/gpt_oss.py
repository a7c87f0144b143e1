"""gpt-oss (openai/gpt-oss-20b, -120b) over the paged KV cache, verified against transformers'
GptOss.

Dimension legend: T tokens in the step, H query heads, G kv heads, Dh head dim, Q = H * Dh, K = G *
Dh.

Per decoder layer (`layer_types[i]` is "sliding_attention" or "full_attention", alternating in the
released configs, sliding first):

    x = rms_norm(hidden)                                   norm weights float32, product cast after
    q, k, v = x @ Wq^T + bq, x @ Wk^T + bk, x @ Wv^T + bv  one fused [Q + 2K, hidden] GEMM + bias
    q, k = rope(q), rope(k)                                YaRN (engine/layers/rotary.py)
    attn = attention(q, k, v, sliding_window, sinks)       sinks [H]: a learned logit per head that
                                                           joins each softmax and takes its share of
                                                           the mass, contributing no value
    hidden += attn @ Wo^T + bo
    hidden += moe(rms_norm(hidden))                        engine/models/gpt_oss_moe.py

then the final norm and an untied lm head. A sliding layer's query at position i sees keys at
positions i - sliding_window + 1 .. i (transformers' `kv_idx > q_idx - sliding_window`); the backend
(engine/layers/attention.py) owns that mask and the sinks' softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.layers.attention import PagedAttentionBackend, layer_metadata
from engine.layers.linear import LinearWeight, fuse_rows
from engine.layers.rotary import RotaryEmbedding, apply_rotary
from engine.models.gpt_oss_moe import GptOssMoE, dequantize_at_load, gpt_oss_moe
from engine.models.llama import CPU, LinearFactory, Weights
from engine.models.vocab_ends import VocabEnds
from engine.models.weights import take


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' GptOssRMSNorm: normalise and scale in float32 (weight float32), then cast."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    return (weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


@dataclass
class GptOssLayer:
    input_norm: torch.Tensor  # [hidden] float32
    post_attention_norm: torch.Tensor  # [hidden] float32
    qkv: LinearWeight  # [Q + 2K, hidden]
    qkv_bias: torch.Tensor  # [Q + 2K]
    o_proj: LinearWeight  # [hidden, Q]
    o_bias: torch.Tensor  # [hidden]
    sinks: torch.Tensor  # [H] float32
    sliding_window: int | None  # None on full-attention layers
    mlp: GptOssMoE


class GptOssModel(VocabEnds):
    def __init__(self, config: ModelConfig, weights: Weights, attention: PagedAttentionBackend,
                 make_linear: LinearFactory, device: torch.device = CPU,
                 dtype: torch.dtype = torch.float32) -> None:
        """Pops every tensor it uses out of `weights` (HF names); a missing or misshapen one, or a
        config this model cannot run, fails here with one line naming it."""
        check_config(config)
        self.config = config
        self._device, self._dtype = device, dtype
        self.attention = attention
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim ** -0.5
        h, v = config.hidden_size, config.vocab_size
        self.embed_tokens = take(weights, "model.embed_tokens.weight", (v, h)).to(device, dtype)
        self.norm = take(weights, "model.norm.weight", (h,)).to(device, torch.float32)
        if config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
            self.lm_head = make_linear("lm_head.weight", self.embed_tokens)
        else:
            self.lm_head = make_linear("lm_head.weight", take(weights, "lm_head.weight", (v, h)))
        scaling = dict(config.rope_scaling) if config.rope_scaling else None
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                      config.rope_theta, scaling, dtype, device)
        dequantize = dequantize_at_load(config, device, dtype)
        self.layers = [self._load_layer(weights, i, make_linear, dequantize)
                       for i in range(config.num_layers)]

    def _load_layer(self, weights: Weights, i: int, make_linear: LinearFactory,
                    dequantize_mxfp4: bool) -> GptOssLayer:
        cfg, p = self.config, f"model.layers.{i}."
        h, sizes = cfg.hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}
        qkv = fuse_rows([take(weights, f"{p}self_attn.{n}_proj.weight", (sizes[n], h))
                         for n in "qkv"])
        qkv_bias = torch.cat([take(weights, f"{p}self_attn.{n}_proj.bias", (sizes[n],))
                              for n in "qkv"])
        return GptOssLayer(
            input_norm=self._norm(take(weights, p + "input_layernorm.weight", (h,))),
            post_attention_norm=self._norm(take(weights, p + "post_attention_layernorm.weight",
                                                (h,))),
            qkv=make_linear(p + "self_attn.qkv_proj.weight", qkv),
            qkv_bias=self._place(qkv_bias),
            o_proj=make_linear(p + "self_attn.o_proj.weight",
                               take(weights, p + "self_attn.o_proj.weight", (h, self.q_size))),
            o_bias=self._place(take(weights, p + "self_attn.o_proj.bias", (h,))),
            sinks=self._norm(take(weights, p + "self_attn.sinks", (cfg.num_heads,))),
            sliding_window=cfg.layer_sliding_window(i),
            mlp=gpt_oss_moe(cfg, weights, i, self._device, self._dtype, dequantize_mxfp4,
                            make_linear),
        )

    def _place(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device=self._device, dtype=self._dtype)

    def _norm(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device=self._device, dtype=torch.float32)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden] (before the lm head)."""
        cfg = self.config
        num_q, num_kv, eps = cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps
        cos, sin = self.rotary.lookup(positions)  # [T, 1, Dh], shared by every layer
        hidden = self.embed(input_ids)  # [T, hidden]
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            qkv = layer.qkv(rms_norm(hidden, layer.input_norm, eps)) + layer.qkv_bias  # [T, Q + 2K]
            heads = qkv.view(-1, num_q + 2 * num_kv, cfg.head_dim)  # [T, H + 2G, Dh]
            qk = apply_rotary(heads[:, : num_q + num_kv], cos, sin)  # q and k heads in one pass
            q, k = qk[:, :num_q], qk[:, num_q:]  # [T, H, Dh], [T, G, Dh]
            v = heads[:, num_q + num_kv :]  # [T, G, Dh]
            attn = self.attention.forward(q, k, v, k_cache, v_cache, self.scale, layer_metadata(i),
                                          sliding_window=layer.sliding_window, sinks=layer.sinks)
            # [T, hidden]
            hidden = hidden + layer.o_proj(attn.reshape(-1, self.q_size)) + layer.o_bias
            hidden = hidden + layer.mlp(rms_norm(hidden, layer.post_attention_norm, eps))
        return rms_norm(hidden, self.norm, eps)


def check_config(config: ModelConfig) -> None:
    """Refuse, in one line, a gpt_oss config this model does not run (ModelConfig itself checks that
    layer_types names every layer with known types and that sliding layers have a window)."""
    if not config.is_moe:
        raise ValueError("gpt_oss config: num_local_experts must be positive")
    if config.layer_types is None:
        raise ValueError("gpt_oss config: layer_types must say which layers slide")
