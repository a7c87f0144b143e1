"""gpt-oss's MoE MLP: a biased router, top-k of the logits then a softmax over the k, and experts
with biases and the clamped SwiGLU; expert weights dense or MXFP4 as the released checkpoints store
them.

Dimension legend:
    T tokens   H hidden   E experts   K experts per token   I expert intermediate size   G = H / 32

    router       [E, H] + bias [E]   logits [T, E]; ids = top-K of the logits, weights = softmax
                                     over the K
    w13          [E, 2I, H]          gate rows 0..I-1, then up rows I..2I-1 (the fused-MoE layout),
                                     + b13 [E, 2I]
    w2           [E, H, I]           + b2 [E, H]
    out [T, H] = sum_k weight[t, k] * (w2[e] @ act(w13[e] @ x + b13[e]) + b2[e]),
                 act = ClampedSwiGLU

Checkpoint tensors (HF names, `p` = "model.layers.{i}.mlp."): p.router.weight/bias and either
    dense (transformers' save_pretrained)   p.experts.gate_up_proj [E, H, 2I], p.experts.down_proj
                                            [E, I, H]
    MXFP4 (the released openai/gpt-oss-*)   p.experts.gate_up_proj_blocks [E, 2I, G, 16] + _scales
                                            [E, 2I, G], p.experts.down_proj_blocks [E, H, I/32, 16]
                                            + _scales [E, H, I/32]
with p.experts.gate_up_proj_bias [E, 2I] and p.experts.down_proj_bias [E, H]. In both files gate and
up are interleaved along 2I (gate = [..., ::2], up = [..., 1::2] in transformers' GptOssExperts);
they are split into halves here at load (for MXFP4 by reordering the blocks' rows: groups run along
H, so a row moves with its scales).

MXFP4 placement, chosen at load:
    CPU     kept as stored (uint8 blocks + scales, ~4.25 bits a weight) and only the experts a step
            routes to are dequantized, per call: gpt-oss-20b's experts are 19.1 G weights, 76 GB in
            float32, which no CPU host we run on holds; a decode token dequantizes K of E experts a
            layer (memory over speed: dequantizing is the CPU step's largest cost).
    CUDA    dequantized to the engine dtype (bfloat16) at load, so every step runs the tuned Triton
            grouped GEMMs of engine/kernels/fused_moe.py (speed over memory: 20b's experts take
            38 GB in bfloat16, 3.8x their MXFP4 bytes, which an 80 GB GPU holds). When the bfloat16
            experts would not fit in 80% of the free device memory (120b: 229 GB), they stay MXFP4
            and run through engine/kernels/fused_moe_mxfp4.py, which dequantizes B tiles in
            registers (memory over speed: its one launch config is untimed; the interpreter tests
            and an sm_90 compile check it, no GPU run has yet).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine import kernels
from engine.config import ModelConfig
from engine.kernels.activation import ClampedSwiGLU
from engine.layers import uses_native_blocks
from engine.layers.linear import DenseLinear, LinearWeight
from engine.layers.mxfp4 import MXFP4Weight
from engine.layers.native_experts import NativeExperts
from engine.models.weights import CheckpointMismatchError, take

logger = logging.getLogger(__name__)
Weights = dict[str, torch.Tensor]
LinearFactory = Callable[[str, torch.Tensor], LinearWeight]


def _split_gate_up(inter: int) -> torch.Tensor:
    """Row order that turns interleaved (gate0, up0, gate1, up1, ...) into (gate..., up...):
    [2I]."""
    return torch.cat([torch.arange(0, 2 * inter, 2), torch.arange(1, 2 * inter, 2)])


class GptOssExperts:
    """The E experts of one layer: dense [E, 2I, H] / [E, H, I] tensors, or MXFP4 weights."""

    def __init__(self, w13: torch.Tensor | MXFP4Weight, w2: torch.Tensor | MXFP4Weight,
                 w13_bias: torch.Tensor, w2_bias: torch.Tensor, dtype: torch.dtype) -> None:
        self.w13, self.w2 = w13, w2
        self.w13_bias, self.w2_bias = w13_bias, w2_bias  # [E, 2I], [E, H]
        self.dtype = dtype

    @property
    def is_mxfp4(self) -> bool:
        return isinstance(self.w13, MXFP4Weight)

    def dense(self, experts: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w13 [E', 2I, H], w2 [E', H, I], b13 [E', 2I], b2 [E', H]) of every expert or of
        `experts` [E']."""
        if isinstance(self.w13, MXFP4Weight) and isinstance(self.w2, MXFP4Weight):
            w13, w2 = (self.w13.dequantize(self.dtype, experts),
                       self.w2.dequantize(self.dtype, experts))
        else:
            assert isinstance(self.w13, torch.Tensor) and isinstance(self.w2, torch.Tensor)
            w13, w2 = ((self.w13, self.w2) if experts is None
                       else (self.w13[experts], self.w2[experts]))
        if experts is None:
            return w13, w2, self.w13_bias, self.w2_bias
        return w13, w2, self.w13_bias[experts], self.w2_bias[experts]

    @property
    def nbytes(self) -> int:
        def size(t: torch.Tensor | MXFP4Weight) -> int:
            return t.nbytes if isinstance(t, MXFP4Weight) else t.numel() * t.element_size()

        return sum(size(t) for t in (self.w13, self.w2, self.w13_bias, self.w2_bias))


class GptOssMoE:
    """x [T, H] -> [T, H]: router top-k, then the experts through `engine.kernels.fused_moe`."""

    def __init__(self, router: DenseLinear, experts: GptOssExperts | NativeExperts, top_k: int,
                 activation: ClampedSwiGLU) -> None:
        self.router = router  # [E, H] + bias [E]
        self.experts = experts
        self.top_k = top_k
        self.activation = activation

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, K] float32, ids [T, K] int32): softmax over the top-K logits."""
        logits = self.router(x)  # [T, E]
        top, ids = torch.topk(logits, self.top_k, dim=-1)  # [T, K], sorted
        return torch.softmax(top.float(), dim=-1), ids.to(torch.int32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        # the CPU default path (biases, activation inside)
        if isinstance(self.experts, NativeExperts):
            return self.experts(x, weights, ids)  # [T, H]
        experts, extra = self.experts, {"activation": self.activation}
        if experts.is_mxfp4 and kernels.kernel_backend(x.device) == "triton":
            from engine.kernels.fused_moe_mxfp4 import fused_moe_mxfp4_triton

            assert isinstance(experts.w13, MXFP4Weight) and isinstance(experts.w2, MXFP4Weight)
            return fused_moe_mxfp4_triton(
                x.contiguous(), experts.w13.blocks, experts.w13.scales, experts.w2.blocks,
                experts.w2.scales, weights, ids, w13_bias=experts.w13_bias, w2_bias=experts.w2_bias,
                **extra)  # [T, H]
        if experts.is_mxfp4:  # CPU: dequantize only the experts this step routes to
            used = torch.unique(ids)  # [E'] sorted
            w13, w2, b13, b2 = self.experts.dense(used.to(torch.int64))
            ids = torch.searchsorted(used, ids).to(torch.int32)  # ids into the E' experts
        else:
            w13, w2, b13, b2 = self.experts.dense()
        return kernels.fused_moe(x.contiguous(), w13, w2, weights, ids, w13_bias=b13, w2_bias=b2,
                                 **extra)  # [T, H]


def gpt_oss_moe(config: ModelConfig, weights: Weights, layer: int, device: torch.device,
                dtype: torch.dtype, dequantize_mxfp4: bool,
                make_linear: LinearFactory | None = None) -> GptOssMoE:
    """Pop layer `layer`'s router and experts (either file layout) out of `weights` and place them;
    MXFP4 experts are dequantized to `dtype` here when `dequantize_mxfp4`, else kept as stored.
    On the CPU default path (`make_linear` puts weights on the native blocks) the experts become
    native per-expert linears instead: MXFP4 re-blocked into Q8_0 exactly, dense ones quantized."""
    p = f"model.layers.{layer}.mlp."
    e, h, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
    router = DenseLinear(take(weights, p + "router.weight", (e, h)).to(device, dtype),
                         take(weights, p + "router.bias", (e,)).to(device, dtype))
    order = _split_gate_up(inter)
    b13 = take(weights, p + "experts.gate_up_proj_bias", (e, 2 * inter))[:, order]
    b2 = take(weights, p + "experts.down_proj_bias", (e, h))
    w13: torch.Tensor | MXFP4Weight
    w2: torch.Tensor | MXFP4Weight
    if p + "experts.gate_up_proj_blocks" in weights:
        for size, name in ((h, "gate_up_proj"), (inter, "down_proj")):
            if size % 32:
                raise CheckpointMismatchError(f"MXFP4 tensor {p}experts.{name}_blocks needs inputs "
                                              "in "
                                              f"groups of 32, the config implies {size}")
        w13 = MXFP4Weight(take(weights, p + "experts.gate_up_proj_blocks",
                               (e, 2 * inter, h // 32, 16)),
                          take(weights, p + "experts.gate_up_proj_scales", (e, 2 * inter, h // 32)))
        w13 = w13.select_rows(order).to(device)
        w2 = MXFP4Weight(take(weights, p + "experts.down_proj_blocks", (e, h, inter // 32, 16)),
                         take(weights, p + "experts.down_proj_scales",
                              (e, h, inter // 32))).to(device)
        if dequantize_mxfp4:
            w13, w2 = w13.dequantize(dtype), w2.dequantize(dtype)
    else:
        # transformers' [E, H, 2I] / [E, I, H] -> rows are outputs: [E, 2I, H] / [E, H, I]
        w13 = take(weights, p + "experts.gate_up_proj", (e, h, 2 * inter))[:, :, order]
        w13 = w13.transpose(1, 2).to(device, dtype).contiguous()
        w2 = take(weights, p + "experts.down_proj", (e, inter, h)).transpose(1, 2).to(device, dtype)
        w2 = w2.contiguous()
    activation = ClampedSwiGLU(alpha=config.swiglu_alpha, limit=config.swiglu_limit)
    if make_linear is not None and uses_native_blocks(make_linear):
        extra = {"w13_bias": b13.float().contiguous(), "w2_bias": b2.float().contiguous(),
                 "activation": activation}
        native = (NativeExperts.from_mxfp4(w13, w2, **extra) if isinstance(w13, MXFP4Weight)
                  and isinstance(w2, MXFP4Weight) else
                  NativeExperts.build(make_linear, p + "experts.", w13, w2, **extra))  # type: ignore[arg-type]
        if native is not None:
            return GptOssMoE(router, native, config.num_experts_per_tok, activation)
    experts = GptOssExperts(w13, w2, b13.to(device, dtype).contiguous(),
                            b2.to(device, dtype).contiguous(), dtype)
    return GptOssMoE(router, experts, config.num_experts_per_tok, activation)


def dequantize_at_load(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """The MXFP4 placement (module docstring): CUDA, and every layer's experts dequantized to
    `dtype` fit in 80% of the free device memory. Decided once, before any layer is placed."""
    if device.type != "cuda":
        return False
    need = (config.num_layers * config.num_experts * 3 * config.moe_intermediate_size
            * config.hidden_size * torch.empty((), dtype=dtype).element_size())
    free, _ = torch.cuda.mem_get_info(device)
    if need <= 0.8 * free:
        return True
    logger.warning("gpt_oss: the experts would take %.1f GiB dequantized, %.1f GiB is free: "
                   "keeping MXFP4 and dequantizing the routed experts per step", need / 2**30,
                   free / 2**30)
    return False
