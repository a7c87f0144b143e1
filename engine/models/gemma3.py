"""Gemma 3 text (Gemma3ForCausalLM, model_type gemma3_text) over the paged KV cache, verified
against transformers' Gemma3 modeling.

Dimension legend: T tokens in the step, H query heads, G kv heads, Dh head dim, Q = H * Dh,
K = G * Dh, I intermediate size.

    hidden = embed(ids) * sqrt(hidden_size)                (the scale cast to the model dtype)
    per layer (local "sliding_attention" window W, or global "full_attention"):
        x = norm(hidden)                                   Gemma's RMSNorm: x / rms(x) * (1 + w),
                                                           in float32, cast after
        q, k, v = x @ Wqkv^T                               one fused [Q + 2K, hidden] GEMM
        q, k = norm_q(q), norm_k(k)                        per head over Dh, (1 + w) again
        q, k = rope(q), rope(k)                            local layers: rope_local_base_freq, no
                                                           scaling; global: rope_theta +
                                                           rope_scaling
        attn = attention(q, k, v, scale=query_pre_attn_scalar ** -0.5, window)
        hidden += post_attention_norm(attn @ Wo^T)
        x = pre_feedforward_norm(hidden)
        hidden += post_feedforward_norm(W_down(gelu_tanh(x W_gate) * x W_up))
    final norm; lm head (tied by default); logits soft-capped c * tanh(logits / c) when
    final_logit_softcapping is set.

Attention-score soft-capping (`attn_logit_softcapping`) is refused at load
(engine/loader/hf_gemma3.py): no backend applies it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.layers.attention import PagedAttentionBackend, layer_metadata
from engine.layers.linear import LinearWeight, fuse_rows
from engine.layers.rotary import RotaryEmbedding, apply_rotary
from engine.models.llama import CPU, LinearFactory
from engine.models.vocab_ends import VocabEnds, lm_head_weight
from engine.models.weights import Weights, take


def gemma_rms_norm(x: torch.Tensor, one_plus_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Gemma3RMSNorm: normalise and scale by (1 + w) in float32, then cast.
    `one_plus_weight` is 1 + w, float32, computed once at load."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
            * one_plus_weight).to(x.dtype)


@dataclass
class Gemma3Layer:
    input_norm: torch.Tensor  # [hidden] float32, each norm stored as 1 + w
    post_attention_norm: torch.Tensor  # [hidden]
    pre_feedforward_norm: torch.Tensor  # [hidden]
    post_feedforward_norm: torch.Tensor  # [hidden]
    q_norm: torch.Tensor  # [Dh]
    k_norm: torch.Tensor  # [Dh]
    qkv: LinearWeight  # [Q + 2K, hidden]
    o_proj: LinearWeight  # [hidden, Q]
    gate_up: LinearWeight  # [2I, hidden]
    down: LinearWeight  # [hidden, I]
    sliding_window: int | None  # None on global layers


class Gemma3Model(VocabEnds):
    def __init__(self, config: ModelConfig, weights: Weights, attention: PagedAttentionBackend,
                 make_linear: LinearFactory, device: torch.device = CPU,
                 dtype: torch.dtype = torch.float32) -> None:
        """Pops every tensor it uses out of `weights` (HF names); a missing or misshapen one fails
        here with one line naming it."""
        if config.gemma is None:
            raise ValueError("gemma3_text config: ModelConfig.gemma is not set")
        self.config, self.gemma = config, config.gemma
        self._device, self._dtype = device, dtype
        self.attention = attention
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = self.gemma.query_pre_attn_scalar ** -0.5
        h, v = config.hidden_size, config.vocab_size
        self.embed_tokens = take(weights, "model.embed_tokens.weight", (v, h)).to(device, dtype)
        # as transformers rounds it
        self.embed_scale = torch.tensor(h ** 0.5, dtype=dtype, device=device)
        self.norm = self._norm(take(weights, "model.norm.weight", (h,)))
        self.lm_head = make_linear("lm_head.weight",
                                   lm_head_weight(config, weights, self.embed_tokens))
        scaling = dict(config.rope_scaling) if config.rope_scaling else None
        self.global_rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                             config.rope_theta, scaling, dtype, device)
        self.local_rotary = (RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                             self.gemma.local_rope_theta, None, dtype, device)
                             if config.has_sliding_layers else None)
        self.layers = [self._load_layer(weights, i, make_linear) for i in range(config.num_layers)]

    def _load_layer(self, weights: Weights, i: int, make_linear: LinearFactory) -> Gemma3Layer:
        cfg, p = self.config, f"model.layers.{i}."
        h, inter, dh = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        sizes = {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}
        qkv = fuse_rows([take(weights, f"{p}self_attn.{n}_proj.weight", (sizes[n], h))
                         for n in "qkv"])
        gate_up = fuse_rows([take(weights, f"{p}mlp.{n}_proj.weight", (inter, h))
                             for n in ("gate", "up")])

        def norm(name: str, size: int) -> torch.Tensor:
            return self._norm(take(weights, p + name + ".weight", (size,)))

        return Gemma3Layer(
            input_norm=norm("input_layernorm", h),
            post_attention_norm=norm("post_attention_layernorm", h),
            pre_feedforward_norm=norm("pre_feedforward_layernorm", h),
            post_feedforward_norm=norm("post_feedforward_layernorm", h),
            q_norm=norm("self_attn.q_norm", dh),
            k_norm=norm("self_attn.k_norm", dh),
            qkv=make_linear(p + "self_attn.qkv_proj.weight", qkv),
            o_proj=make_linear(p + "self_attn.o_proj.weight",
                               take(weights, p + "self_attn.o_proj.weight", (h, self.q_size))),
            gate_up=make_linear(p + "mlp.gate_up_proj.weight", gate_up),
            down=make_linear(p + "mlp.down_proj.weight",
                             take(weights, p + "mlp.down_proj.weight", (h, inter))),
            sliding_window=cfg.layer_sliding_window(i),
        )

    def _norm(self, weight: torch.Tensor) -> torch.Tensor:
        return 1.0 + weight.to(device=self._device, dtype=torch.float32)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden] (before the lm head)."""
        cfg = self.config
        num_q, num_kv, eps = cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps
        ropes = {None: self.global_rotary.lookup(positions)}  # [T, 1, Dh] cos, sin per layer kind
        if self.local_rotary is not None:
            ropes["local"] = self.local_rotary.lookup(positions)
        hidden = self.embed(input_ids) * self.embed_scale  # [T, hidden]
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            qkv = layer.qkv(gemma_rms_norm(hidden, layer.input_norm, eps))  # [T, Q + 2K]
            heads = qkv.view(-1, num_q + 2 * num_kv, cfg.head_dim)  # [T, H + 2G, Dh]
            qk = torch.cat([gemma_rms_norm(heads[:, :num_q], layer.q_norm, eps),
                            gemma_rms_norm(heads[:, num_q : num_q + num_kv], layer.k_norm, eps)],
                           dim=1)  # [T, H + G, Dh]
            cos, sin = ropes["local" if layer.sliding_window is not None else None]
            qk = apply_rotary(qk, cos, sin)
            q, k = qk[:, :num_q], qk[:, num_q:]  # [T, H, Dh], [T, G, Dh]
            v = heads[:, num_q + num_kv :]  # [T, G, Dh]
            attn = self.attention.forward(q, k, v, k_cache, v_cache, self.scale, layer_metadata(i),
                                          sliding_window=layer.sliding_window)
            # [T, H, Dh] -> [T, Q] -> [T, hidden]
            attn = layer.o_proj(attn.reshape(-1, self.q_size))
            hidden = hidden + gemma_rms_norm(attn, layer.post_attention_norm, eps)
            gate, up = layer.gate_up(gemma_rms_norm(hidden, layer.pre_feedforward_norm,
                                                    eps)).chunk(2, -1)
            mlp = layer.down(F.gelu(gate, approximate="tanh") * up)  # [T, I] -> [T, hidden]
            hidden = hidden + gemma_rms_norm(mlp, layer.post_feedforward_norm, eps)
        return gemma_rms_norm(hidden, self.norm, eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] (the rows to sample from) -> soft-capped logits [S, vocab] in float32.
        (`embed` is VocabEnds', unscaled: forward multiplies by embed_scale.)"""
        return soft_cap(super().compute_logits(hidden), self.gemma.final_logit_softcapping)


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """c * tanh(logits / c) (None: unchanged)."""
    return logits if cap is None else torch.tanh(logits / cap) * cap
