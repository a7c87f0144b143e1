"""MoE experts on the native CPU kernels: one pair of quantized linears per expert, each run over
the tokens routed to it (the CPU default path; `--exact` keeps float32 experts in the fused MoE).

Dimension legend: T tokens, H hidden, E experts, K experts per token, P = T * K (token, expert)
pairs, I expert intermediate size, n the pairs routed to one expert.

    for each expert e with pairs (ascending e):
        x_e   = x[tokens of its pairs]                          [n, H]   (times the pair's weight
                                                                          when the router scales the
                                                                          input)
        h     = q_linear(x_e, W13_e)  (+ b13_e)                 [n, 2I]  gate rows, then up rows
        y     = q_linear(act(h), W2_e)  (+ b2_e)                [n, H]   act = SiLU-and-mul (fused
                                                                          into the kernel) or
                                                                          ClampedSwiGLU
        out[token] += weight * y                                [T, H]

Every row of a native linear is computed alone (engine/layers/native_linear.py), and a token's K
contributions are added in ascending expert order, so a token's output does not depend on the
other tokens of the step: the same request gives the same tokens alone or in a batch.

Weights come from the model's linear factory, one call per expert with per-expert names
(`...experts.{e}.gate_up_proj.weight`, `...experts.{e}.down_proj.weight`): a GGUF's own blocks for
them where the loader kept them, else the float weight quantized at load.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.kernels.activation import ClampedSwiGLU, clamped_swiglu_reference
from engine.layers.block_quant import mxfp4_to_q8_0
from engine.layers.linear import LinearWeight
from engine.layers.mxfp4 import MXFP4Weight
from engine.layers.native_linear import NativeQuantLinear

LinearFactory = Callable[[str, torch.Tensor], LinearWeight]


class NativeExperts:
    """The E experts of one layer as native linears (module docstring)."""

    def __init__(self, w13: list[NativeQuantLinear], w2: list[NativeQuantLinear],
                 w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                 activation: ClampedSwiGLU | None = None) -> None:
        self.w13, self.w2 = w13, w2  # E x [2I, H], E x [H, I]
        self.w13_bias, self.w2_bias = w13_bias, w2_bias  # [E, 2I], [E, H] float32 or None
        self.activation = activation  # None: SiLU-and-mul

    @classmethod
    def build(cls, make_linear: LinearFactory, prefix: str, w13: torch.Tensor, w2: torch.Tensor,
              **extra: object) -> NativeExperts | None:
        """Experts `prefix{e}.gate_up_proj` = w13[e] [2I, H] and `prefix{e}.down_proj` = w2[e]
        [H, I] through `make_linear`; None when one of them does not take the native blocks (its
        shape does not fit the kernels): the caller keeps float experts."""
        first, second = [], []
        for e in range(w13.shape[0]):
            gate_up = make_linear(f"{prefix}{e}.gate_up_proj.weight", w13[e].float().contiguous())
            down = make_linear(f"{prefix}{e}.down_proj.weight", w2[e].float().contiguous())
            if not (isinstance(gate_up, NativeQuantLinear) and isinstance(down, NativeQuantLinear)):
                return None
            first.append(gate_up)
            second.append(down)
        return cls(first, second, **extra)  # type: ignore[arg-type]

    @classmethod
    def from_mxfp4(cls, w13: MXFP4Weight, w2: MXFP4Weight, **extra: object) -> NativeExperts | None:
        """MXFP4 experts (gpt-oss) re-blocked into Q8_0, exactly (engine/layers/block_quant.py);
        None when an expert's rows do not come in groups of 8."""
        if w13.shape[1] % 8 or w2.shape[1] % 8:
            return None
        def q8(weight: MXFP4Weight, e: int) -> NativeQuantLinear:
            rows = mxfp4_to_q8_0(weight.blocks[e], weight.scales[e])
            return NativeQuantLinear.from_raw([("Q8_0", rows)], quantized_at_load=True)

        num_experts = w13.shape[0]
        return cls([q8(w13, e) for e in range(num_experts)],
                   [q8(w2, e) for e in range(num_experts)],
                   **extra)  # type: ignore[arg-type]

    @property
    def num_experts(self) -> int:
        return len(self.w13)

    @property
    def block_type(self) -> str:
        return self.w13[0].block_type

    @property
    def quantized_at_load(self) -> bool:
        return self.w13[0].quantized_at_load

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 scale_inputs: bool = False) -> torch.Tensor:
        """x [T, H] float32, topk_weights [T, K], topk_ids [T, K] -> [T, H] float32.
        `scale_inputs`: each pair's weight scales the expert's input, not its output (Llama 4)."""
        num_tokens, top_k = topk_ids.shape
        flat = topk_ids.flatten().to(torch.int64)  # [P]
        order = torch.argsort(flat, stable=True)  # [P] pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # [E]
        flat_weights = topk_weights.flatten().float()  # [P]
        out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32)  # [T, H]
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            pairs = order[start : start + n]  # [n]
            start += n
            tokens = pairs // top_k  # [n]
            routed = x.index_select(0, tokens)  # [n, H]
            if scale_inputs:
                routed = routed * flat_weights[pairs, None]
            y = self._expert(expert, routed)  # [n, H]
            out.index_add_(0, tokens, y if scale_inputs else y * flat_weights[pairs, None])
        return out

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """x [n, H] -> expert e's output [n, H]."""
        if self.activation is None and self.w13_bias is None:
            return self.w2[e].silu_mul_native(self.w13[e](x))  # [n, 2I] -> [n, H]
        gate_up = self.w13[e](x)  # [n, 2I]
        if self.w13_bias is not None:
            gate_up = gate_up + self.w13_bias[e]
        if self.activation is None:
            return self._down(e, self.w2[e].silu_mul_native(gate_up))
        return self._down(e, self.w2[e](clamped_swiglu_reference(gate_up, self.activation)))

    def _down(self, e: int, y: torch.Tensor) -> torch.Tensor:
        return y + self.w2_bias[e] if self.w2_bias is not None else y

    @property
    def nbytes(self) -> int:
        biases = [b for b in (self.w13_bias, self.w2_bias) if b is not None]
        return (sum(w.nbytes for w in self.w13 + self.w2)
                + sum(b.numel() * b.element_size() for b in biases))
