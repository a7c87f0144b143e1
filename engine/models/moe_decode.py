"""The fused native step (engine/models/llama_decode.py) for the Llama-family MoE models on the CPU
default path: qwen3_moe and mixtral (softmax top-k routers, no attention biases, no projection q/k
norm), and qwen2_moe without biases. The attention half of a layer is NativeDecodeStep's (q_linear
with the input norm fused, the native attention over a float16 KV cache, o_proj added in place);
the MLP half of a sparse layer runs the layer's MoE on its native experts:

    x = rms_norm(hidden, post_attention_norm)                    [M, H]
    hidden += router top-k -> per-expert q_linear pairs (+ shared expert)   (engine/models/moe.py)

and a dense layer (`mlp_only_layers`) keeps NativeDecodeStep's two fused ops. Like that step it
takes every row, decode and prefill alike, each computed alone (the experts add a token's
contributions in ascending expert order), so a request's tokens do not depend on its batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.native_experts import NativeExperts
from engine.layers.native_linear import NativeQuantLinear
from engine.layers.norm import rms_norm_fast
from engine.models.llama import DenseMLP, LlamaModel
from engine.models.llama_decode import DecodeInputs, NativeDecodeStep, _native, _norm_qk_heads
from engine.models.moe import MoEMLP


class NativeMoEDecodeStep(NativeDecodeStep):
    @classmethod
    def build(cls, model: LlamaModel) -> NativeMoEDecodeStep | None:  # type: ignore[override]
        """The step for `model` when every layer fits (module docstring), else None."""
        cfg = model.config
        if (not isinstance(model, LlamaModel) or not cfg.is_moe or cfg.attention_bias or cfg.mla
                or cfg.gemma or cfg.llama4 or cfg.head_dim % 8 or cfg.has_sliding_layers
                or cfg.qk_norm not in (None, "per_head") or model.embed_tokens.dtype != torch.float32
                or not isinstance(model.lm_head, NativeQuantLinear)):
            return None
        for layer in model.layers:
            if not (isinstance(layer.qkv, NativeQuantLinear) and isinstance(layer.o_proj, NativeQuantLinear)):
                return None
            mlp = layer.mlp
            if isinstance(mlp, DenseMLP):
                if not (isinstance(mlp.gate_up, NativeQuantLinear) and isinstance(mlp.down, NativeQuantLinear)):
                    return None
            elif not (isinstance(mlp, MoEMLP) and isinstance(mlp.experts, NativeExperts)):
                return None
        return cls(model)

    def __call__(self, step: DecodeInputs, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                 ) -> torch.Tensor:
        """-> logits [S, vocab] float32 of `step.logit_rows` (every row when None)."""
        model, cfg = self.model, self.model.config
        eps = cfg.rms_norm_eps
        cos, sin = model.rotary.cos, model.rotary.sin  # [P, Dh]
        hidden = F.embedding(step.input_ids, model.embed_tokens)  # [M, H]: this step's own tensor
        for layer, (k_cache, v_cache) in zip(model.layers, kv_caches, strict=True):
            qkv = _native(layer.qkv).native(hidden, layer.input_norm, eps)  # [M, (H + 2G) * Dh]
            if cfg.qk_norm == "per_head":
                _norm_qk_heads(qkv, layer, cfg)
            attn = torch.ops.aigw_cpu.decode_attention(
                qkv, cos, sin, step.positions, k_cache, v_cache, step.slots, step.block_tables,
                step.context_lens, cfg.num_heads, cfg.num_kv_heads, model.scale)  # [M, H * Dh]
            _native(layer.o_proj).add_into(hidden, attn)
            mlp = layer.mlp
            if isinstance(mlp, DenseMLP):  # a dense layer between sparse ones: the fused pair
                gate_up = _native(mlp.gate_up).native(hidden, layer.post_attention_norm, eps)  # [M, 2I]
                _native(mlp.down).add_into(hidden, gate_up, silu_and_mul=True)
            else:
                hidden += mlp(rms_norm_fast(hidden, layer.post_attention_norm, eps))  # [M, H]
        if step.logit_rows is not None:
            hidden = hidden.index_select(0, step.logit_rows)  # [S, H]
        return _native(model.lm_head).native(hidden, model.norm, eps)
