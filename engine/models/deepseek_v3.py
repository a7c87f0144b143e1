"""DeepSeek-V3 / R1 and Kimi-K2 (model_type deepseek_v3) over the paged KV cache, verified against
transformers' DeepseekV3: multi-head latent attention (MLA) whose cache holds only the latent.

Dimension legend: T tokens in the step, H query heads, R kv_lora_rank, P qk_rope_head_dim,
N qk_nope_head_dim, V v_head_dim, Lq q_lora_rank. DeepSeek-V3-671B: H 128, R 512, P 64, N 128, V
128.

Per layer (checkpoint names under model.layers.{i}.self_attn.):

    q   = q_b_proj(rms_norm(q_a_proj(x)))  [T, H, N + P]   (q_lora_rank null: q_proj(x))
    kv  = kv_a_proj_with_mqa(x)            [T, R + P]
    c   = rms_norm(kv[:, :R])              the latent            kv_a_layernorm
    kr  = rope(kv[:, R:])                  the rope key, one for every head
    K_nope, V per head = c @ W_UK^T, c @ W_UV^T     kv_b_proj [H * (N + V), R] = per head [W_UK;
                                                    W_UV]
    score = (q_nope . K_nope + rope(q_rope) . kr) * scale,  out = softmax(score) @ V -> o_proj

The KV cache stores, per token and layer, only [c, kr]: one "kv head" of R + P values (ModelConfig:
num_kv_heads 1, head_dim R + P, K and V one tensor: `kv_is_shared`), through the same block pool,
prefix hashing and KV events as every model. Attention is computed in the *absorbed* form, so the
stock paged backend (engine/layers/attention.py) runs it unchanged as multi-query attention:

    q' = [q_nope @ W_UK, rope(q_rope)]  [T, H, R + P]   k = v = [c, kr]  [T, 1, R + P]
    q' . k = q_nope . (W_UK^T c) + rope(q_rope) . kr       (the expanded score, reassociated)
    out = (softmax @ [c, kr])[:, :, :R] @ W_UV^T  [T, H, V]

Why absorbed, not expanded: the expanded form needs per-step K_nope/V of every context position,
i.e. a second attention path that gathers and up-projects the cached latent; the absorbed one is
exact up to float reassociation (float32 logprobs within 1e-5 of transformers') and reuses the
backend with its chunked prefill, cascade and windows as they are. It costs H * (R + P) per score
instead of H * (N + P) (3x for V3's sizes): fine on the CPU, and what vLLM's decode does too.

rope: on the P rope dims only, in interleaved pairs (x0, x1), (x2, x3) ... as transformers'
`apply_rotary_pos_emb_interleave` (rope_interleave true, the default; false: rotate-half). YaRN from
rope_scaling with mscale / mscale_all_dim (engine/layers/rotary.py); the softmax scale is
(N + P)^-0.5 * (0.1 * mscale_all_dim * ln(factor) + 1)^2 when factor > 1 and mscale_all_dim set.
MTP layers (num_nextn_predict_layers; tensors of model.layers.{i} with i >= num_hidden_layers) are
not run: their tensors are dropped at load.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from engine.config import MLAConfig, ModelConfig
from engine.layers.attention import PagedAttentionBackend, layer_metadata
from engine.layers.linear import LinearWeight
from engine.layers.norm import rms_norm_fast
from engine.layers.rotary import RotaryEmbedding, apply_rotary
from engine.models.deepseek_v3_moe import DeepseekV3MoE, deepseek_v3_mlp
from engine.models.llama import CPU, DenseMLP, LinearFactory, Weights
from engine.models.vocab_ends import VocabEnds
from engine.models.weights import take

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def mla_softmax_scale(config: ModelConfig) -> float:
    """(N + P)^-0.5, times yarn_mscale(factor, mscale_all_dim)^2 under YaRN (transformers' rule)."""
    mla = _mla(config)
    scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
    scaling = dict(config.rope_scaling or ())
    factor, mscale_all_dim = float(scaling.get("factor", 1.0)), scaling.get("mscale_all_dim")  # type: ignore[arg-type]
    if scaling and mscale_all_dim and factor > 1:
        mscale = 0.1 * float(mscale_all_dim) * math.log(factor) + 1.0  # type: ignore[arg-type]
        scale *= mscale * mscale
    return scale


def kv_bytes_per_token_mla_and_full(config: ModelConfig, element_size: int) -> tuple[int, int]:
    """(MLA's cache bytes per token over all layers, a full per-head K/V layout's for the same
    model: K of N + P and V of V per head)."""
    mla = _mla(config)
    latent = mla.kv_lora_rank + mla.qk_rope_head_dim
    full = config.num_heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim)
    return (config.num_layers * latent * element_size, config.num_layers * full * element_size)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, P] with pairs (x0, x1), (x2, x3) ... -> rotated, laid out [evens', odds'] as
    transformers' apply_rotary_pos_emb_interleave (q and k alike, so their dot products agree).
    cos/sin [T, 1, P] = cat(freqs, freqs)."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


@dataclass
class MLALayer:
    input_norm: torch.Tensor  # [hidden]
    post_attention_norm: torch.Tensor  # [hidden]
    q_a: LinearWeight | None  # [Lq, hidden] (None: q is one projection)
    q_a_norm: torch.Tensor | None  # [Lq]
    q_b: LinearWeight  # [H * (N + P), Lq or hidden]
    kv_a: LinearWeight  # [R + P, hidden]
    kv_a_norm: torch.Tensor  # [R]
    w_uk: torch.Tensor  # [H, N, R]  kv_b_proj's K rows per head
    w_uv: torch.Tensor  # [H, V, R]  its V rows
    o_proj: LinearWeight  # [hidden, H * V]
    mlp: DeepseekV3MoE | DenseMLP


class DeepseekV3Model(VocabEnds):
    def __init__(self, config: ModelConfig, weights: Weights, attention: PagedAttentionBackend,
                 make_linear: LinearFactory, device: torch.device = CPU,
                 dtype: torch.dtype = torch.float32) -> None:
        """Pops every tensor it uses out of `weights` (HF names); a missing or misshapen one fails
        here with one line naming it. MTP-layer tensors (layer index >= num_layers) are dropped."""
        mla = _mla(config)
        self.config, self.mla = config, mla
        self._device, self._dtype = device, dtype
        self.attention = attention
        self.scale = mla_softmax_scale(config)
        h, v = config.hidden_size, config.vocab_size
        for name in [n for n in weights
                     if (m := _LAYER.match(n)) and int(m[1]) >= config.num_layers]:
            weights.pop(name)  # multi-token-prediction layers: not run
        self.embed_tokens = take(weights, "model.embed_tokens.weight", (v, h)).to(device, dtype)
        self.norm = self._place(take(weights, "model.norm.weight", (h,)))
        if config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
            self.lm_head = make_linear("lm_head.weight", self.embed_tokens)
        else:
            self.lm_head = make_linear("lm_head.weight", take(weights, "lm_head.weight", (v, h)))
        scaling = dict(config.rope_scaling) if config.rope_scaling else None
        self.rotary = RotaryEmbedding(mla.qk_rope_head_dim, config.max_position_embeddings,
                                      config.rope_theta, scaling, dtype, device)
        self.layers = [self._load_layer(weights, i, make_linear) for i in range(config.num_layers)]

    def _load_layer(self, weights: Weights, i: int, make_linear: LinearFactory) -> MLALayer:
        cfg, mla, p = self.config, self.mla, f"model.layers.{i}."
        a, h, heads = p + "self_attn.", cfg.hidden_size, cfg.num_heads
        qk, r, what = (mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.kv_lora_rank,
                       f"deepseek_v3 layer {i}")
        if mla.q_lora_rank is None:
            q_a = q_a_norm = None
            q_b = make_linear(a + "q_proj.weight",
                              take(weights, a + "q_proj.weight", (heads * qk, h), what))
        else:
            lq = mla.q_lora_rank
            q_a = make_linear(a + "q_a_proj.weight",
                              take(weights, a + "q_a_proj.weight", (lq, h), what))
            q_a_norm = self._place(take(weights, a + "q_a_layernorm.weight", (lq,), what))
            q_b = make_linear(a + "q_b_proj.weight",
                              take(weights, a + "q_b_proj.weight", (heads * qk, lq), what))
        kv_b = take(weights, a + "kv_b_proj.weight",
                    (heads * (mla.qk_nope_head_dim + mla.v_head_dim), r), what)
        # [H, N + V, R]
        kv_b = self._place(kv_b).view(heads, mla.qk_nope_head_dim + mla.v_head_dim, r)
        return MLALayer(
            input_norm=self._place(take(weights, p + "input_layernorm.weight", (h,), what)),
            post_attention_norm=self._place(
                take(weights, p + "post_attention_layernorm.weight", (h,), what)),
            q_a=q_a, q_a_norm=q_a_norm, q_b=q_b,
            kv_a=make_linear(a + "kv_a_proj_with_mqa.weight",
                             take(weights, a + "kv_a_proj_with_mqa.weight",
                                  (r + mla.qk_rope_head_dim, h), what)),
            kv_a_norm=self._place(take(weights, a + "kv_a_layernorm.weight", (r,), what)),
            w_uk=kv_b[:, : mla.qk_nope_head_dim].contiguous(),
            w_uv=kv_b[:, mla.qk_nope_head_dim :].contiguous(),
            o_proj=make_linear(a + "o_proj.weight",
                               take(weights, a + "o_proj.weight", (h, heads * mla.v_head_dim),
                                    what)),
            mlp=deepseek_v3_mlp(cfg, weights, i, make_linear),
        )

    def _place(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device=self._device, dtype=self._dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden] (before the lm head).
        kv_caches[i] is (latent, latent): one [num_blocks, block_size, 1, R + P] tensor twice."""
        cfg, mla, eps = self.config, self.mla, self.config.rms_norm_eps
        nope, r, heads = mla.qk_nope_head_dim, mla.kv_lora_rank, cfg.num_heads
        rotate = apply_rotary_interleaved if mla.rope_interleave else apply_rotary
        cos, sin = self.rotary.lookup(positions)  # [T, 1, P]
        hidden = self.embed(input_ids)  # [T, hidden]
        for i, (layer, (latent_cache, _)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x = rms_norm_fast(hidden, layer.input_norm, eps)
            if layer.q_a is not None:
                x_q = rms_norm_fast(layer.q_a(x), layer.q_a_norm, eps)  # type: ignore[arg-type]
            else:
                x_q = x
            q = layer.q_b(x_q).view(-1, heads, nope + mla.qk_rope_head_dim)  # [T, H, N + P]
            kv = layer.kv_a(x)  # [T, R + P]
            latent = rms_norm_fast(kv[:, :r].contiguous(), layer.kv_a_norm, eps)  # [T, R]
            k_rope = rotate(kv[:, None, r:], cos, sin)  # [T, 1, P]
            q_latent = torch.einsum("thn,hnr->thr", q[..., :nope], layer.w_uk)  # [T, H, R]
            q_full = torch.cat([q_latent, rotate(q[..., nope:], cos, sin)], dim=-1)  # [T, H, R + P]
            k = torch.cat([latent[:, None], k_rope], dim=-1)  # [T, 1, R + P]: what the cache holds
            out = self.attention.forward(q_full, k, k, latent_cache, latent_cache, self.scale,
                                         layer_metadata(i))  # [T, H, R + P]
            attn = torch.einsum("thr,hvr->thv", out[..., :r], layer.w_uv)  # [T, H, V]
            hidden = hidden + layer.o_proj(attn.reshape(-1, heads * mla.v_head_dim))
            hidden = hidden + layer.mlp(rms_norm_fast(hidden, layer.post_attention_norm, eps))
        return rms_norm_fast(hidden, self.norm, eps)


def _mla(config: ModelConfig) -> MLAConfig:
    if config.mla is None or config.grouped_topk is None:
        raise ValueError(f"{config.architecture} config: deepseek_v3 needs its MLA and routing "
                         "fields")
    return config.mla
