"""Llama 4 text (Llama4ForCausalLM, model_type llama4_text) over the paged KV cache, verified
against transformers' Llama4 modeling.

Dimension legend: T tokens in the step, H query heads, G kv heads, Dh head dim, Q = H * Dh,
K = G * Dh, E experts, k experts per token, I expert (and shared expert) size, M dense MLP size.

    hidden = embed(ids)
    per layer, RoPE (chunked local attention of chunk C) or NoPE (global):
        x = rms_norm(hidden)
        q, k, v = x @ Wqkv^T                          one fused [Q + 2K, hidden] GEMM
        RoPE layer:  q, k = rope(q), rope(k)          then, with use_qk_norm, q, k = l2_norm(q),
                                                      l2_norm(k) (per head over Dh, no weight, eps =
                                                      rms_norm_eps)
        NoPE layer:  q *= 1 + attn_scale * log1p(floor((p + 1) / floor_scale))
                                                      (temperature tuning)
        attn = attention(q, k, v, scale=Dh ** -0.5, RoPE layer: its own chunk of C positions only)
        hidden += attn @ Wo^T
        x = rms_norm(hidden)
        MoE layer:   hidden += shared(x) + sum_k expert_{e_k}(x * sigmoid(top-k router logit_k))
                     (the router's score scales the expert's input, not its output)
        dense layer: hidden += W_down(silu(x W_gate) * x W_up)          (size M =
                                                                         intermediate_size_mlp)
    final norm; lm head (untied by default).

RoPE pairs: transformers rotates interleaved pairs (x[2i], x[2i + 1]) as complex numbers; the q/k
rows of each head are permuted at load (evens, then odds) so the engine's rotate-half rope computes
the same rotation. q . k is unchanged by one permutation of both, and so is the L2 norm.

Attention backends: the torch backend (CPU) and the Triton kernels (CUDA) both mask chunks
(engine/kernels/paged_attention.py, paged_decode.py: tested in Triton's interpreter).

KV: the NoPE layers form the full-attention KV group(s); the chunked layers form chunk groups
(engine/kv_cache/layout.py) that release a chunk's blocks once the sequence enters the next chunk
(engine/kv_cache/manager.py), and the attention masks the other chunks' positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import kernels
from engine.config import ModelConfig
from engine.layers import uses_native_blocks
from engine.layers.attention import PagedAttentionBackend, layer_metadata
from engine.layers.linear import DenseLinear, LinearWeight, fuse_rows
from engine.layers.native_experts import NativeExperts
from engine.layers.norm import rms_norm
from engine.layers.rotary import RotaryEmbedding, apply_rotary
from engine.models.llama import CPU, DenseMLP, LinearFactory
from engine.models.vocab_ends import VocabEnds, lm_head_weight
from engine.models.weights import Weights, take


class Llama4MoE:
    """x [T, hidden] -> [T, hidden]: sigmoid top-k routed SwiGLU experts plus a shared expert."""

    def __init__(self, router: DenseLinear, w13: torch.Tensor | None, w2: torch.Tensor | None,
                 top_k: int, shared: DenseMLP, native: NativeExperts | None = None) -> None:
        self.router = router  # [E, hidden]
        # [E, 2I, hidden]: gate rows, then up rows (None: `native` holds the experts)
        self.w13 = w13
        self.w2 = w2  # [E, hidden, I]
        self.top_k = top_k
        self.shared = shared
        self.native = native  # the CPU default path: per-expert native linears

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)  # [T, E]
        top_logits, top_ids = torch.topk(logits, self.top_k, dim=-1)  # [T, k]
        scores = torch.sigmoid(top_logits.float()).to(x.dtype)  # [T, k]
        out = self.shared(x)  # [T, hidden]
        if self.native is not None:  # the score scales each expert's input
            return out + self.native(x, scores, top_ids, scale_inputs=True)
        assert self.w13 is not None and self.w2 is not None
        ones = torch.ones_like(scores[:, :1])  # [T, 1]: the score already scaled the input
        for j in range(self.top_k):
            routed_in = (x * scores[:, j : j + 1]).contiguous()  # [T, hidden]
            out = out + kernels.fused_moe(routed_in, self.w13, self.w2, ones,
                                          top_ids[:, j : j + 1].to(torch.int32))
        return out


@dataclass
class Llama4Layer:
    input_norm: torch.Tensor  # [hidden]
    post_attention_norm: torch.Tensor  # [hidden]
    qkv: LinearWeight  # [Q + 2K, hidden], q/k rows permuted for rotate-half rope
    o_proj: LinearWeight  # [hidden, Q]
    mlp: DenseMLP | Llama4MoE
    uses_rope: bool  # RoPE + chunked attention, else NoPE + global attention


def rope_pair_permutation(head_dim: int) -> torch.Tensor:
    """[Dh] row order turning interleaved rope pairs (2i, 2i + 1) into rotate-half's (i, i + Dh /
    2)."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


class Llama4Model(VocabEnds):
    def __init__(self, config: ModelConfig, weights: Weights, attention: PagedAttentionBackend,
                 make_linear: LinearFactory, device: torch.device = CPU,
                 dtype: torch.dtype = torch.float32) -> None:
        """Pops every tensor it uses out of `weights` (HF names); a missing or misshapen one fails
        here with one line naming it."""
        if config.llama4 is None:
            raise ValueError("llama4_text config: ModelConfig.llama4 is not set")
        self.config, self.llama4 = config, config.llama4
        self._device, self._dtype = device, dtype
        self.attention = attention
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim ** -0.5
        h, v = config.hidden_size, config.vocab_size
        self.embed_tokens = self._place(take(weights, "model.embed_tokens.weight", (v, h)))
        self.norm = self._place(take(weights, "model.norm.weight", (h,)))
        self.lm_head = make_linear("lm_head.weight",
                                   lm_head_weight(config, weights, self.embed_tokens))
        scaling = dict(config.rope_scaling) if config.rope_scaling else None
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                      config.rope_theta, scaling, dtype, device)
        self.layers = [self._load_layer(weights, i, make_linear) for i in range(config.num_layers)]

    def _place(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device=self._device, dtype=self._dtype)

    def _load_layer(self, weights: Weights, i: int, make_linear: LinearFactory) -> Llama4Layer:
        cfg, p = self.config, f"model.layers.{i}."
        h, dh = cfg.hidden_size, cfg.head_dim
        a = p + "self_attn."
        perm = rope_pair_permutation(dh)

        def heads_permuted(weight: torch.Tensor) -> torch.Tensor:  # [n * Dh, hidden], per head
            return weight.view(-1, dh, h)[:, perm].reshape(-1, h)

        q = heads_permuted(take(weights, a + "q_proj.weight", (self.q_size, h)))
        k = heads_permuted(take(weights, a + "k_proj.weight", (self.kv_size, h)))
        qkv = fuse_rows([q, k, take(weights, a + "v_proj.weight", (self.kv_size, h))])
        return Llama4Layer(
            input_norm=self._place(take(weights, p + "input_layernorm.weight", (h,))),
            post_attention_norm=self._place(take(weights, p + "post_attention_layernorm.weight",
                                                 (h,))),
            qkv=make_linear(a + "qkv_proj.weight", qkv),
            o_proj=make_linear(a + "o_proj.weight",
                               take(weights, a + "o_proj.weight", (h, self.q_size))),
            mlp=self._load_mlp(weights, i, make_linear),
            uses_rope=self.llama4.rope_layers[i],
        )

    def _load_mlp(self, weights: Weights, i: int,
                  make_linear: LinearFactory) -> DenseMLP | Llama4MoE:
        cfg, f = self.config, f"model.layers.{i}.feed_forward."
        h = cfg.hidden_size

        def swiglu(prefix: str, size: int) -> DenseMLP:
            gate_up = fuse_rows([take(weights, prefix + "gate_proj.weight", (size, h)),
                                 take(weights, prefix + "up_proj.weight", (size, h))])
            return DenseMLP(make_linear(prefix + "gate_up_proj.weight", gate_up),
                            make_linear(prefix + "down_proj.weight",
                                        take(weights, prefix + "down_proj.weight", (h, size))))

        if i not in self.llama4.moe_layers:
            return swiglu(f, self.llama4.intermediate_size_mlp)
        num_experts, inter = cfg.num_experts, cfg.moe_intermediate_size
        what = f"llama4_text layer {i}"
        router = DenseLinear(self._place(take(weights, f + "router.weight", (num_experts, h),
                                              what)))
        gate_up = take(weights, f + "experts.gate_up_proj", (num_experts, h, 2 * inter), what)
        down = take(weights, f + "experts.down_proj", (num_experts, inter, h), what)
        w13, w2 = gate_up.transpose(1, 2), down.transpose(1, 2)  # [E, 2I, hidden], [E, hidden, I]
        shared = swiglu(f + "shared_expert.", inter)
        if uses_native_blocks(make_linear):
            native = NativeExperts.build(make_linear, f + "experts.", w13, w2)
            if native is not None:
                return Llama4MoE(router, None, None, cfg.num_experts_per_tok, shared, native)
        return Llama4MoE(router, self._place(w13).contiguous(), self._place(w2).contiguous(),
                         cfg.num_experts_per_tok, shared)

    def _temperature(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [T] -> the NoPE layers' query scale [T, 1, 1] float32."""
        cfg = self.llama4
        floor = torch.floor((positions.float() + 1.0) / cfg.floor_scale)
        # float32, as transformers
        return (torch.log1p(floor) * cfg.attn_scale + 1.0)[:, None, None]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden] (before the lm head)."""
        cfg, l4 = self.config, self.llama4
        num_q, num_kv, eps = cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps
        cos, sin = self.rotary.lookup(positions)  # [T, 1, Dh]
        temperature = self._temperature(positions) if l4.attn_temperature_tuning else None
        hidden = self.embed(input_ids)  # [T, hidden]
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            qkv = layer.qkv(rms_norm(hidden, layer.input_norm, eps))  # [T, Q + 2K]
            heads = qkv.view(-1, num_q + 2 * num_kv, cfg.head_dim)  # [T, H + 2G, Dh]
            qk = heads[:, : num_q + num_kv]  # [T, H + G, Dh]
            if layer.uses_rope:
                qk = apply_rotary(qk, cos, sin)
                if l4.use_qk_norm:
                    qk = l2_norm(qk, eps)
            q, k = qk[:, :num_q], qk[:, num_q:]  # [T, H, Dh], [T, G, Dh]
            if not layer.uses_rope and temperature is not None:
                q = (q * temperature).to(q.dtype)
            v = heads[:, num_q + num_kv :]  # [T, G, Dh]
            chunk = l4.attention_chunk_size if layer.uses_rope else None
            attn = self.attention.forward(q, k, v, k_cache, v_cache, self.scale, layer_metadata(i),
                                          attention_chunk=chunk)
            hidden = hidden + layer.o_proj(attn.reshape(-1, self.q_size))  # [T, Q] -> [T, hidden]
            hidden = hidden + layer.mlp(rms_norm(hidden, layer.post_attention_norm, eps))
        return rms_norm(hidden, self.norm, eps)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama4TextL2Norm: x / rms(x) over the last dim in float32, no weight."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

