"""The native steps of a Llama model: decode rows (and, in the q4 mode, prefill chunks) through
engine/kernels/cpu.

`NativeDecodeStep` (the q4 mode, every linear a `NativeQuantLinear`): 5 ops a layer, float16 KV.
`FloatDecodeStep` (the float32 mode, oneDNN linears): the native attention (float32 KV) between
float32 GEMMs, ~9 ops a layer. `build` returns None for anything else (biases, OLMoE's projection qk
norm, MoE, other dtypes), and the runner keeps the general forward. Qwen3's per-head q/k norm runs
between the qkv projection and the attention kernel (which applies the rotary), as two F.rms_norm
over the q and k heads (+2 ops a layer). Per layer of the q4 step:

    qkv = q_linear(hidden, W_qkv, rms_norm=input_norm)                 [M, (H + 2G) * Dh]
    attn = decode_attention(qkv, rotary, k/v cache, slots, block tables, context lens)   [M, H * Dh]
    hidden += q_linear(attn, W_o)                                      (in place)
    gate_up = q_linear(hidden, W_gate_up, rms_norm=post_attention_norm)  [M, 2I]
    hidden += q_linear(silu(gate) * up, W_down)                        (in place)

then logits = q_linear(hidden[rows that sample], W_lm_head, rms_norm=final norm). It fuses the norms,
rotary, the KV store, SiLU-and-mul and the residual adds into the kernels, so a step dispatches ~5 ops
per layer instead of ~60: at one sequence the eager step spent more time dispatching ops than reading
weights.

In the q4 mode the runner sends every row here, decode rows and prefill chunks alike (`runs_prefill`):
a chunk of C tokens is C rows, row i attending to the context up to its own position (the attention
kernel tiles a chunk's rows so each pass over the K/V serves 16 of them), so prefill pays for no
element-wise ops, K/V gathers or float16-to-float32 copies between the kernels (through the general
forward they took ~45% of a profiled 1,024-token q4 prefill; this path took it from 560 to 763
tokens/s in an A/B run, bench/results/engine-cpu.md has the later figures). Every row is computed alone and in the same order whatever else the step
holds, so a sequence's tokens do not depend on what it was batched with, nor on how its prompt was
chunked. The float32 mode sends only decode rows (prefill chunks take the general forward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.layers.linear import DenseLinear, LinearWeight, OneDNNLinear
from engine.layers.native_linear import NativeQuantLinear
from engine.layers.norm import rms_norm_fast
from engine.models.llama import DecoderLayer, DenseMLP, LlamaModel


@dataclass(frozen=True)
class DecodeInputs:
    """One step of M rows, one token each: a decode row, or one token of a prefill chunk (its row
    attends to the positions up to its own, like a decode row). Integer tensors are int64 on the CPU."""

    input_ids: torch.Tensor  # [M]
    positions: torch.Tensor  # [M] position of the token (= context length - 1)
    slots: torch.Tensor  # [M] where its K/V goes: block_id * block_size + offset
    block_tables: torch.Tensor  # [M, W] blocks of each row's context, padded with block 0
    context_lens: torch.Tensor  # [M] positions to attend to, the row's own included
    logit_rows: torch.Tensor | None = None  # [S] rows that get logits, in order; None: every row


class NativeDecodeStep:
    kv_dtype = torch.float16  # half the bytes the attention reads per step; the q4 mode is approximate
    runs_prefill = True  # prefill chunks take this step too, a row per token (see the module doc)

    def __init__(self, model: LlamaModel) -> None:
        self.model = model

    @classmethod
    def build(cls, model: LlamaModel) -> NativeDecodeStep | None:
        if not isinstance(model.lm_head, NativeQuantLinear) or not _plain_layers_of(model, NativeQuantLinear):
            return None
        return cls(model)

    def __call__(self, step: DecodeInputs, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                 ) -> torch.Tensor:
        """-> logits [S, vocab] float32 of `step.logit_rows` (every row when None)."""
        model, cfg = self.model, self.model.config
        eps = cfg.rms_norm_eps
        cos, sin = model.rotary.cos, model.rotary.sin  # [P, Dh]
        hidden = F.embedding(step.input_ids, model.embed_tokens)  # [M, hidden]: this step's own tensor
        for layer, (k_cache, v_cache) in zip(model.layers, kv_caches, strict=True):
            qkv_proj, o_proj = _native(layer.qkv), _native(layer.o_proj)
            mlp: DenseMLP = layer.mlp  # type: ignore[assignment]
            qkv = qkv_proj.native(hidden, layer.input_norm, eps)  # [M, (H + 2G) * Dh]
            if cfg.qk_norm == "per_head":
                _norm_qk_heads(qkv, layer, cfg)
            attn = torch.ops.aigw_cpu.decode_attention(
                qkv, cos, sin, step.positions, k_cache, v_cache, step.slots, step.block_tables,
                step.context_lens, cfg.num_heads, cfg.num_kv_heads, model.scale)  # [M, H * Dh]
            o_proj.add_into(hidden, attn)
            gate_up = _native(mlp.gate_up).native(hidden, layer.post_attention_norm, eps)  # [M, 2I]
            _native(mlp.down).add_into(hidden, gate_up, silu_and_mul=True)
        if step.logit_rows is not None:
            hidden = hidden.index_select(0, step.logit_rows)  # [S, hidden]
        return _native(model.lm_head).native(hidden, model.norm, eps)


def _plain_layers_of(model: LlamaModel, linear_type: type | tuple[type, ...]) -> bool:
    """True when every layer is the plain Llama shape a decode step handles (no biases, no qk norm
    but Qwen3's per head, a dense MLP, full attention, float32 embeddings, head_dim a multiple of 8)
    with all four linears `linear_type`. (The native attention kernel has no sliding window: such
    models keep the general forward, whose attention backends do.)"""
    cfg = model.config
    if (cfg.attention_bias or cfg.is_moe or cfg.mla or cfg.gemma or cfg.llama4 or cfg.head_dim % 8
            or cfg.has_sliding_layers or model.embed_tokens.dtype != torch.float32):
        return False
    for layer in model.layers:
        if not isinstance(layer.mlp, DenseMLP) or cfg.qk_norm not in (None, "per_head"):
            return False
        linears = [layer.qkv, layer.o_proj, layer.mlp.gate_up, layer.mlp.down]
        if not all(isinstance(w, linear_type) for w in linears):
            return False
    return True


def _norm_qk_heads(qkv: torch.Tensor, layer: DecoderLayer, cfg: ModelConfig) -> None:
    """Qwen3's per-head RMSNorm of the q and k heads of qkv [M, (H + 2G) * Dh], in place (before
    the attention kernel's rotary), as LlamaModel.forward computes it."""
    num_q, num_kv, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    heads = qkv.view(qkv.shape[0], num_q + 2 * num_kv, head_dim)  # [M, H + 2G, Dh]
    heads[:, :num_q] = F.rms_norm(heads[:, :num_q], (head_dim,), layer.q_norm, cfg.rms_norm_eps)
    heads[:, num_q:num_q + num_kv] = F.rms_norm(heads[:, num_q:num_q + num_kv], (head_dim,),
                                                layer.k_norm, cfg.rms_norm_eps)


def _native(linear: object) -> NativeQuantLinear:
    assert isinstance(linear, NativeQuantLinear)
    return linear


class FloatDecodeStep:
    """Float32 weights, float32 KV: the general forward's math for decode rows (F.rms_norm, oneDNN
    GEMMs with the residual add fused), with the native attention reading K/V straight from the cache
    blocks instead of gathering them for SDPA (at 32 rows the gather alone cost ~23 ms a step)."""

    kv_dtype = torch.float32
    runs_prefill = False  # prefill chunks take the general forward (SDPA, oneDNN GEMMs at many rows)

    def __init__(self, model: LlamaModel) -> None:
        self.model = model

    @classmethod
    def build(cls, model: LlamaModel) -> FloatDecodeStep | None:
        return cls(model) if _plain_layers_of(model, (OneDNNLinear, DenseLinear)) else None

    def __call__(self, step: DecodeInputs, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                 ) -> torch.Tensor:
        """-> logits [M, vocab] float32."""
        model, cfg = self.model, self.model.config
        eps = cfg.rms_norm_eps
        cos, sin = model.rotary.cos, model.rotary.sin  # [P, Dh]
        hidden = F.embedding(step.input_ids, model.embed_tokens)  # [M, hidden]
        for layer, (k_cache, v_cache) in zip(model.layers, kv_caches, strict=True):
            mlp: DenseMLP = layer.mlp  # type: ignore[assignment]
            qkv = layer.qkv(rms_norm_fast(hidden, layer.input_norm, eps))  # [M, (H + 2G) * Dh]
            if cfg.qk_norm == "per_head":
                _norm_qk_heads(qkv, layer, cfg)
            attn = torch.ops.aigw_cpu.decode_attention(
                qkv, cos, sin, step.positions, k_cache, v_cache, step.slots, step.block_tables,
                step.context_lens, cfg.num_heads, cfg.num_kv_heads, model.scale)  # [M, H * Dh]
            hidden = _add_linear(hidden, layer.o_proj, attn)
            gate, up = mlp.gate_up(rms_norm_fast(hidden, layer.post_attention_norm, eps)).chunk(2, dim=-1)
            hidden = _add_linear(hidden, mlp.down, F.silu(gate) * up)
        return model.compute_logits(rms_norm_fast(hidden, model.norm, eps))


def _add_linear(residual: torch.Tensor, linear: LinearWeight, x: torch.Tensor) -> torch.Tensor:
    """residual + x @ W^T, as one oneDNN call (fused add) when the weight is prepacked for it."""
    if isinstance(linear, OneDNNLinear):
        return linear.add_to(residual, x)
    return residual + linear(x)
