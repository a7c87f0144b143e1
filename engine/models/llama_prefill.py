"""Prompt chunks of a q4 Llama model with bfloat16 GEMMs: the prefill half of the q4 mode on a CPU
with AMX-BF16 or AVX512-BF16 (engine/kernels/cpu/isa.py `prefill`); decode rows stay on the integer
kernels (engine/models/llama_decode.py), over the same float16 KV cache: the native step's
layer loop with these kernels.

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

from typing import Any

import torch
import torch.nn.functional as F

from engine.layers.bf16_linear import Bf16Scratch, bf16_linear
from engine.layers.norm import rms_norm_fast
from engine.models.llama_decode import ONE_PROCESS, Q4_KERNELS, NativeStep, Reduce, native_step

BF16 = torch.bfloat16


class Bf16Kernels:
    """The q4 mode's weights, prompt rows' GEMMs in bf16 (module doc); the lm head stays integer."""

    name = "bf16"
    kv_dtype = torch.float16  # the q4 mode's cache
    runs_prefill = True

    def __init__(self, scratch: Bf16Scratch) -> None:
        self.scratch = scratch

    def normed(self, linear: Any, x: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor:
        return bf16_linear(rms_norm_fast(x, norm, eps).to(BF16), linear, self.scratch).float()

    def add(self, residual: torch.Tensor, linear: Any, x: torch.Tensor, reduce: Reduce,
            silu_and_mul: bool = False) -> torch.Tensor:
        """residual + x @ W^T (a new tensor; one process: `reduce` is None)."""
        if silu_and_mul:
            gate, up = x.chunk(2, dim=-1)  # 2 x [M, I]
            x = F.silu(gate) * up
        return residual + bf16_linear(x.to(BF16), linear, self.scratch).float()

    logits = staticmethod(Q4_KERNELS.logits)


def bf16_prefill_step(model: Any, scratch: Bf16Scratch | None = None) -> NativeStep | None:
    """Prompt rows of a dense model the q4 native step serves in one process (every linear and the
    lm head a NativeQuantLinear, every layer a DenseMLP), their GEMMs in bf16; else None: MoE
    models keep their integer prefill. Each row is computed alone and in the same order whatever
    else the step holds. The step takes `step.logit_rows` and returns their [S, vocab] logits."""
    step = native_step(model, "q4")
    if step is None or step.kernels is not Q4_KERNELS or model.config.is_moe:
        return None
    return NativeStep(model, Bf16Kernels(scratch or Bf16Scratch()), ONE_PROCESS, "Bf16PrefillStep")
