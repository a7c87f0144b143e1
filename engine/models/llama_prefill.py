"""Prompt chunks of a q4 Llama model with bfloat16 GEMMs: the prefill half of the q4 mode on a CPU
with AMX-BF16 or AVX512-BF16 (engine/kernels/cpu/isa.py `prefill`); decode rows stay on the integer
kernels (engine/models/llama_decode.py NativeDecodeStep), over the same float16 KV cache.

Dimension legend: M prompt rows of the step (every chunk's, a row per token), H query heads, G kv
heads, Dh head dim, I intermediate size. Per layer:

    x = rms_norm(hidden) -> bf16                                        [M, hidden]
    qkv = bf16_linear(x, W_qkv) -> float32                              [M, (H + 2G) * Dh]
    attn = decode_attention(qkv, rotary, k/v cache, slots, block tables, context lens)   [M, H * Dh]
    hidden += bf16_linear(attn -> bf16, W_o)                            (float32 residual)
    gate_up = bf16_linear(rms_norm(hidden) -> bf16, W_gate_up)          [M, 2I]
    hidden += bf16_linear(silu(gate) * up -> bf16, W_down)

then logits = the integer lm head of the rows that sample (a few rows: the GEMV the integer kernel
is fast at). The GEMMs run in oneDNN's bf16 kernels (AMX tiles or vdpbf16ps, float32 accumulation,
each product rounded to bf16 once), the weights dequantized tile by tile into one bounded scratch
(engine/layers/bf16_linear.py). The residual stream, norms, rotary and attention stay float32.

Attention is the native kernel's (float32 over the float16 cache, the chunk's rows tiled against
each pass over K/V), not SDPA in bf16: SDPA's CPU kernel picks its K/V block size from the context
length, so a row's softmax sums in another order when its prompt is chunked otherwise (measured:
a 300-token chunk's rows differ from the same rows inside a 600-token one by up to 5e-4), and a
sequence's output must depend neither on its batch nor on its chunking (the scheduler's token
budget, which other requests share, decides the chunks). The native kernel computes each row alone
in a fixed order, and needs no gather of the context out of the cache blocks.

Numerics: bf16 keeps 8 significant bits (relative rounding <= 2^-9), so each GEMM's inputs and
output carry ~0.3% of relative error against the float32 product of the same (dequantized) weights,
where the integer path's 8-bit activation blocks carry more (127 steps span each 32-value block's
largest magnitude): the default model's prompt logits land ~3x closer to float32's than the
integer path's (tests/engine/test_bf16_prefill.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.bf16_linear import Bf16Scratch, bf16_linear
from engine.layers.native_linear import NativeQuantLinear
from engine.layers.norm import rms_norm_fast
from engine.models.llama import DenseMLP, LlamaModel
from engine.models.llama_decode import DecodeInputs, NativeDecodeStep, _norm_qk_heads

BF16 = torch.bfloat16


class Bf16PrefillStep:
    """Prompt rows of a model NativeDecodeStep serves (every linear a NativeQuantLinear), their
    GEMMs in bf16. Each row is computed alone and in the same order whatever else the step holds."""

    def __init__(self, model: LlamaModel, scratch: Bf16Scratch | None = None) -> None:
        self.model = model
        self.scratch = scratch or Bf16Scratch()

    @classmethod
    def build(cls, model: LlamaModel) -> Bf16PrefillStep | None:
        """The step for a dense model NativeDecodeStep serves (every layer a DenseMLP, all four
        linears and the lm head NativeQuantLinear), else None: MoE models (moe_decode.py) keep
        their integer prefill."""
        if NativeDecodeStep.build(model) is None:
            return None
        for layer in model.layers:
            mlp = layer.mlp
            if not isinstance(mlp, DenseMLP) or not all(
                    isinstance(w, NativeQuantLinear) for w in (layer.qkv, layer.o_proj, mlp.gate_up, mlp.down)):
                return None
        return cls(model)

    def __call__(self, step: DecodeInputs, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                 ) -> torch.Tensor:
        """`step`: prompt rows, a row per token (row i attends to the positions up to its own).
        -> logits [S, vocab] float32 of `step.logit_rows` (every row when None)."""
        model, cfg = self.model, self.model.config
        eps = cfg.rms_norm_eps
        cos, sin = model.rotary.cos, model.rotary.sin  # [P, Dh]
        hidden = F.embedding(step.input_ids, model.embed_tokens)  # [M, hidden] float32
        for layer, (k_cache, v_cache) in zip(model.layers, kv_caches, strict=True):
            mlp: DenseMLP = layer.mlp  # type: ignore[assignment]
            x = rms_norm_fast(hidden, layer.input_norm, eps).to(BF16)
            qkv = self._linear(x, layer.qkv).float()  # [M, (H + 2G) * Dh]
            if cfg.qk_norm == "per_head":
                _norm_qk_heads(qkv, layer, cfg)
            attn = torch.ops.aigw_cpu.decode_attention(
                qkv, cos, sin, step.positions, k_cache, v_cache, step.slots, step.block_tables,
                step.context_lens, cfg.num_heads, cfg.num_kv_heads, model.scale)  # [M, H * Dh]
            hidden = hidden + self._linear(attn.to(BF16), layer.o_proj).float()
            x = rms_norm_fast(hidden, layer.post_attention_norm, eps).to(BF16)
            gate, up = self._linear(x, mlp.gate_up).float().chunk(2, dim=-1)  # 2 x [M, I]
            hidden = hidden + self._linear((F.silu(gate) * up).to(BF16), mlp.down).float()
        if step.logit_rows is not None:
            hidden = hidden.index_select(0, step.logit_rows)  # [S, hidden]
        lm_head = model.lm_head
        assert isinstance(lm_head, NativeQuantLinear)
        return lm_head.native(hidden, model.norm, eps)

    def _linear(self, x: torch.Tensor, weight: object) -> torch.Tensor:
        assert isinstance(weight, NativeQuantLinear)
        return bf16_linear(x, weight, self.scratch)
