"""Llama-family decoder (Llama, SmolLM, Mistral, Qwen2, Qwen3 dense) over the paged KV cache.

Weights arrive with Hugging Face names; q/k/v are fused into one [Q+2K, hidden] matrix and gate/up
into one [2I, hidden] matrix at load, so each layer runs three GEMMs plus o_proj. The MLP of a layer
is a callable (`DenseMLP` here; MoE families plug theirs in through `mlp_factory`). Every tensor is
taken with the shape the config implies (engine/models/weights.py: a misfit is one error line at
load).

Dimension legend: T tokens, H query heads, G kv heads, Dh head_dim (from the config; Qwen3's need
not be hidden / H), Q = H * Dh, K = G * Dh, I intermediate size.

q/k normalisation (`ModelConfig.qk_norm`), an RMSNorm before RoPE:
    "projection"  OLMoE: over the whole q [T, Q] and k [T, K] (weights [Q], [K])
    "per_head"    Qwen3: over each head's Dh, q [T, H, Dh] and k [T, G, Dh] (weights [Dh])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.layers.attention import PagedAttentionBackend, layer_metadata
from engine.layers.linear import DenseLinear, LinearWeight, fuse_rows
from engine.layers.native_linear import NativeQuantLinear
from engine.layers.norm import rms_norm, rms_norm_fast
from engine.layers.rotary import RotaryEmbedding, apply_rotary
from engine.models.vocab_ends import VocabEnds, lm_head_weight
from engine.models.weights import Weights, take, take_optional

CPU = torch.device("cpu")
LinearFactory = Callable[[str, torch.Tensor], LinearWeight]  # (hf name, dense weight) -> linear


class DenseMLP:
    def __init__(self, gate_up: LinearWeight, down: LinearWeight) -> None:
        self.gate_up = gate_up  # [2I, H]
        self.down = down  # [H, I]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)  # [T, 2I]
        if isinstance(self.down, NativeQuantLinear):  # SiLU-and-mul fused into the down projection
            return self.down.silu_mul_native(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)  # 2 x [T, I]
        return self.down(F.silu(gate) * up)


MLPFactory = Callable[[ModelConfig, Weights, int,
                       LinearFactory], Callable[[torch.Tensor], torch.Tensor]]


def dense_mlp_factory(config: ModelConfig, weights: Weights, layer: int,
                      make_linear: LinearFactory) -> DenseMLP:
    p = f"model.layers.{layer}.mlp."
    hidden, inter = config.hidden_size, config.intermediate_size
    gate_up = fuse_rows([take(weights, p + "gate_proj.weight", (inter, hidden)),
                         take(weights, p + "up_proj.weight", (inter, hidden))])
    return DenseMLP(make_linear(p + "gate_up_proj.weight", gate_up),
                    make_linear(p + "down_proj.weight",
                                take(weights, p + "down_proj.weight", (hidden, inter))))


@dataclass
class DecoderLayer:
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv: LinearWeight
    o_proj: LinearWeight
    mlp: Callable[[torch.Tensor], torch.Tensor]
    q_norm: torch.Tensor | None = None  # [Q] ("projection") or [Dh] ("per_head"): see module doc
    k_norm: torch.Tensor | None = None  # [K] or [Dh]


class LlamaModel(VocabEnds):
    def __init__(self, config: ModelConfig, weights: Weights, attention: PagedAttentionBackend,
                 make_linear: LinearFactory, mlp_factory: MLPFactory = dense_mlp_factory,
                 device: torch.device = CPU, dtype: torch.dtype = torch.float32) -> None:
        """Linear weights are placed by `make_linear`; everything else (embeddings, norms, biases,
        the rotary tables) goes to `device` in `dtype` here."""
        self.config = config
        self._device, self._dtype = device, dtype
        self.attention = attention
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim ** -0.5
        vocab_hidden = (config.vocab_size, config.hidden_size)
        self.embed_tokens = self._place(take(weights, "model.embed_tokens.weight", vocab_hidden))
        self.norm = self._place(take(weights, "model.norm.weight", (config.hidden_size,)))
        self.lm_head = make_linear("lm_head.weight",
                                   lm_head_weight(config, weights, self.embed_tokens))
        scaling = dict(config.rope_scaling) if config.rope_scaling else None
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                      config.rope_theta, scaling, dtype, device)
        self.layers = [self._load_layer(weights, i, make_linear, mlp_factory)
                       for i in range(config.num_layers)]

    def _load_layer(self, weights: Weights, i: int, make_linear: LinearFactory,
                    mlp_factory: MLPFactory) -> DecoderLayer:
        p, cfg = f"model.layers.{i}.self_attn.", self.config
        hidden = cfg.hidden_size
        rows = {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}  # Q, K, K
        qkv = fuse_rows([take(weights, f"{p}{n}_proj.weight", (rows[n], hidden)) for n in "qkv"])
        bias = None
        if cfg.attention_bias:
            bias = self._place(torch.cat([take(weights, f"{p}{n}_proj.bias", (rows[n],))
                                          for n in "qkv"]))
        qkv_linear = (DenseLinear(self._place(qkv), bias) if bias is not None
                      else make_linear(p + "qkv_proj.weight", qkv))
        o_weight = take(weights, p + "o_proj.weight", (hidden, self.q_size))
        o_bias = take_optional(weights, p + "o_proj.bias", (hidden,))  # Llama with attention_bias
        o_proj = (DenseLinear(self._place(o_weight), self._place(o_bias)) if o_bias is not None
                  else make_linear(p + "o_proj.weight", o_weight))
        q_norm = k_norm = None
        if cfg.qk_norm is not None:
            per_head = cfg.qk_norm == "per_head"
            q_norm = self._place(take(weights, p + "q_norm.weight",
                                      (cfg.head_dim,) if per_head else (self.q_size,)))
            k_norm = self._place(take(weights, p + "k_norm.weight",
                                      (cfg.head_dim,) if per_head else (self.kv_size,)))
        norm_shape = (hidden,)
        return DecoderLayer(
            input_norm=self._place(take(weights, f"model.layers.{i}.input_layernorm.weight",
                                        norm_shape)),
            post_attention_norm=self._place(
                take(weights, f"model.layers.{i}.post_attention_layernorm.weight", norm_shape)),
            qkv=qkv_linear,
            o_proj=o_proj,
            mlp=mlp_factory(cfg, weights, i, make_linear),
            q_norm=q_norm,
            k_norm=k_norm,
        )

    def _place(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device=self._device, dtype=self._dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden] (before the lm head)."""
        cfg = self.config
        num_q, num_kv, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        cos, sin = self.rotary.lookup(positions)  # [T, 1, Dh], shared by every layer
        hidden = self.embed(input_ids)  # [T, hidden]
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x = rms_norm_fast(hidden, layer.input_norm, cfg.rms_norm_eps)
            qkv = layer.qkv(x)  # [T, Q + 2K]
            if cfg.qk_norm == "projection":
                q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
                q, k = self.projection_qk_norm(q, k, layer)
                qkv = torch.cat([q, k, v], dim=-1)
            heads = qkv.view(-1, num_q + 2 * num_kv, head_dim)  # [T, H + 2G, Dh]
            qk = heads[:, : num_q + num_kv]  # [T, H + G, Dh]
            if cfg.qk_norm == "per_head":
                qk = torch.cat([rms_norm_fast(qk[:, :num_q], layer.q_norm, cfg.rms_norm_eps),  # type: ignore[arg-type]
                                rms_norm_fast(qk[:, num_q:], layer.k_norm, cfg.rms_norm_eps)],  # type: ignore[arg-type]
                               dim=1)  # [T, H, Dh] + [T, G, Dh] -> [T, H + G, Dh]
            qk = apply_rotary(qk, cos, sin)  # q and k heads in one pass
            q, k = qk[:, :num_q], qk[:, num_q:]  # [T, H, Dh], [T, G, Dh]
            v = heads[:, num_q + num_kv :]  # [T, G, Dh]
            attn = self.attention.forward(q, k, v, k_cache, v_cache, self.scale, layer_metadata(i),
                                          sliding_window=cfg.layer_sliding_window(i))
            hidden = hidden + layer.o_proj(attn.reshape(-1, self.q_size))  # [T, H, Dh] -> [T, Q]
            x = rms_norm_fast(hidden, layer.post_attention_norm, cfg.rms_norm_eps)
            hidden = hidden + layer.mlp(x)
        return rms_norm_fast(hidden, self.norm, cfg.rms_norm_eps)

    def projection_qk_norm(self, q: torch.Tensor, k: torch.Tensor, layer: DecoderLayer
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """OLMoE's q/k norm over the whole projection: q [T, Q], k [T, K] -> the same, normalised. A
        tensor-parallel rank sets an instance attribute of the same name, whose sums of squares span
        every rank's heads (engine/parallel/layers.py)."""
        eps = self.config.rms_norm_eps
        return rms_norm(q, layer.q_norm, eps), rms_norm(k, layer.k_norm, eps)  # type: ignore[arg-type]
