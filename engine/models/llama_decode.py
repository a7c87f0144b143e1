"""The native decode step of a Llama model: decode-only batches through engine/kernels/cpu, 5 ops a layer.

Built from a `LlamaModel` whose linears are all `NativeQuantLinear` (the q4 mode with the native
kernels); `NativeDecodeStep.build` returns None for anything else (biases, qk norm, MoE, non-float32),
and the runner keeps the general forward. Per layer:

    qkv = q_linear(hidden, W_qkv, rms_norm=input_norm)                 [M, (H + 2G) * Dh]
    attn = decode_attention(qkv, rotary, k/v cache, slots, block tables, context lens)   [M, H * Dh]
    hidden += q_linear(attn, W_o)                                      (in place)
    gate_up = q_linear(hidden, W_gate_up, rms_norm=post_attention_norm)  [M, 2I]
    hidden += q_linear(silu(gate) * up, W_down)                        (in place)

then logits = q_linear(hidden, W_lm_head, rms_norm=final norm). It fuses the norms, rotary, the
KV store, SiLU-and-mul and the residual adds into the kernels, so a step dispatches ~5 ops per layer
instead of ~60: at one sequence the eager step spent more time dispatching ops than reading weights.

The runner sends every decode row here, whatever else the step holds (prefill chunks take the
general forward), so a sequence's tokens do not depend on what it was batched with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.layers.native_linear import NativeQuantLinear
from engine.models.llama import DenseMLP, LlamaModel


@dataclass(frozen=True)
class DecodeInputs:
    """One decode-only step, M rows (one new token each). Integer tensors are int64 on the CPU."""

    input_ids: torch.Tensor  # [M]
    positions: torch.Tensor  # [M] position of the new token (= context length - 1)
    slots: torch.Tensor  # [M] where its K/V goes: block_id * block_size + offset
    block_tables: torch.Tensor  # [M, W] blocks of each row's context, padded with block 0
    context_lens: torch.Tensor  # [M] positions to attend to, the new one included


class NativeDecodeStep:
    def __init__(self, model: LlamaModel) -> None:
        self.model = model

    @classmethod
    def build(cls, model: LlamaModel) -> NativeDecodeStep | None:
        cfg = model.config
        if (cfg.attention_bias or cfg.is_moe or cfg.head_dim % 8
                or model.embed_tokens.dtype != torch.float32):
            return None
        if not isinstance(model.lm_head, NativeQuantLinear):
            return None
        for layer in model.layers:
            if not isinstance(layer.mlp, DenseMLP) or layer.q_norm is not None:
                return None
            linears = [layer.qkv, layer.o_proj, layer.mlp.gate_up, layer.mlp.down]
            if not all(isinstance(w, NativeQuantLinear) for w in linears):
                return None
        return cls(model)

    def __call__(self, step: DecodeInputs, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                 ) -> torch.Tensor:
        """-> logits [M, vocab] float32."""
        model, cfg = self.model, self.model.config
        eps = cfg.rms_norm_eps
        cos, sin = model.rotary.cos, model.rotary.sin  # [P, Dh]
        hidden = F.embedding(step.input_ids, model.embed_tokens)  # [M, hidden]: this step's own tensor
        for layer, (k_cache, v_cache) in zip(model.layers, kv_caches, strict=True):
            qkv_proj, o_proj = _native(layer.qkv), _native(layer.o_proj)
            mlp: DenseMLP = layer.mlp  # type: ignore[assignment]
            qkv = qkv_proj.native(hidden, layer.input_norm, eps)  # [M, (H + 2G) * Dh]
            attn = torch.ops.aigw_cpu.decode_attention(
                qkv, cos, sin, step.positions, k_cache, v_cache, step.slots, step.block_tables,
                step.context_lens, cfg.num_heads, cfg.num_kv_heads, model.scale)  # [M, H * Dh]
            o_proj.add_into(hidden, attn)
            gate_up = _native(mlp.gate_up).native(hidden, layer.post_attention_norm, eps)  # [M, 2I]
            _native(mlp.down).add_into(hidden, gate_up, silu_and_mul=True)
        return _native(model.lm_head).native(hidden, model.norm, eps)


def _native(linear: object) -> NativeQuantLinear:
    assert isinstance(linear, NativeQuantLinear)
    return linear
