"""Mixture-of-experts MLPs: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE, plugged into LlamaModel as its
`mlp_factory`. Layers that `ModelConfig.is_sparse_layer` says are not sparse (Qwen-MoE's
`mlp_only_layers` / `decoder_sparse_step`) get the dense MLP of `intermediate_size` instead.

Dimension legend:
    T  tokens     H  hidden     E  experts     K  experts per token (top-k)
    I  expert intermediate size     S  shared-expert intermediate size (Qwen2-MoE)

    router        [E, H]        logits = x @ router^T, softmax over E, top-K (renormalised when
                                `norm_topk_prob`: always for Mixtral, per config for Qwen-MoE /
                                OLMoE)
    w13           [E, 2I, H]    gate rows 0..I-1, then up rows I..2I-1 (one grouped GEMM)
    w2            [E, H, I]
    out [T, H]  = sum_k topk_weights[t, k] * w2[e] @ (silu(w13[e, :I] @ x) * (w13[e, I:] @ x)), e =
                  topk_ids[t, k] (+ sigmoid(shared_gate @ x) * shared_mlp(x) for Qwen2-MoE)

The experts run through `engine.kernels.fused_moe` (the Triton grouped GEMMs on CUDA, the torch
reference on the CPU, which loops only over the experts that received tokens).

Checkpoint layouts read (HF names, `p` = "model.layers.{i}."):
    per expert (Hub files; what transformers 5 `save_pretrained` still writes):
        mixtral          p.block_sparse_moe.gate.weight,
                         p.block_sparse_moe.experts.{e}.w1/w3/w2.weight
        qwen2_moe, qwen3_moe, olmoe
                         p.mlp.gate.weight, p.mlp.experts.{e}.gate_proj/up_proj/down_proj.weight
    fused (transformers 5 in-memory modules, any family):
        p.mlp.gate.weight, p.mlp.experts.gate_up_proj [E, 2I, H], p.mlp.experts.down_proj [E, H, I]
    qwen2_moe shared expert: p.mlp.shared_expert.gate_proj/up_proj/down_proj.weight,
                             p.mlp.shared_expert_gate.weight

Routers and the shared-expert gate stay dense in the engine dtype (also under FP8: top-k is
sensitive to small logit errors). Under `--quantization fp8` the experts are kept in FP8 with
per-row scales and dequantized per layer call, on the CPU only the experts the step routes to
(memory, not speed: there is no FP8 grouped-GEMM kernel yet, so on CUDA the whole layer is
dequantized per call).
"""

from __future__ import annotations

import torch

from engine import kernels
from engine.config import ModelConfig
from engine.kernels.fp8 import quantize_weight_per_channel
from engine.layers import uses_native_blocks
from engine.layers.fp8_linear import FP8Linear
from engine.layers.linear import DenseLinear, LinearWeight, OneDNNLinear, fuse_rows
from engine.layers.native_experts import NativeExperts
from engine.models.llama import DenseMLP, LinearFactory, Weights, dense_mlp_factory
from engine.models.weights import take, take_optional

_EXPERT_NAMES = {  # family -> (module prefix, gate, up, down) of the per-expert layout
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "olmoe": ("mlp", "gate_proj", "up_proj", "down_proj"),
}


class ExpertWeights:
    """The stacked experts of one layer, dense or FP8 (per output row scales)."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype, fp8: bool) -> None:
        self.dtype = dtype
        self.fp8 = fp8
        if fp8:
            num_experts = w13.shape[0]
            w13_q, w13_scale = quantize_weight_per_channel(w13.flatten(0, 1))  # [E*2I, H], [E*2I]
            w2_q, w2_scale = quantize_weight_per_channel(w2.flatten(0, 1))  # [E*H, I], [E*H]
            self.w13 = w13_q.view(w13.shape)  # [E, 2I, H] fp8
            self.w2 = w2_q.view(w2.shape)  # [E, H, I] fp8
            self.w13_scale = w13_scale.view(num_experts, -1, 1)  # [E, 2I, 1]
            self.w2_scale = w2_scale.view(num_experts, -1, 1)  # [E, H, 1]
        elif kernels.kernel_backend(w13.device) == "triton":
            self.w13 = w13.to(dtype).contiguous()
            self.w2 = w2.to(dtype).contiguous()
        else:  # the torch reference takes any strides (expert copies made with expand cost nothing)
            self.w13, self.w2 = w13.to(dtype), w2.to(dtype)

    def dense(self, experts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E', 2I, H], w2 [E', H, I]) in the engine dtype: every expert, or only `experts`
        [E'] (FP8: only those are dequantized)."""
        if not self.fp8:
            return (self.w13, self.w2) if experts is None else (self.w13[experts], self.w2[experts])
        index = slice(None) if experts is None else experts
        return ((self.w13[index].float() * self.w13_scale[index]).to(self.dtype),
                (self.w2[index].float() * self.w2_scale[index]).to(self.dtype))

    @property
    def nbytes(self) -> int:
        tensors = [self.w13, self.w2] + ([self.w13_scale, self.w2_scale] if self.fp8 else [])
        return sum(t.numel() * t.element_size() for t in tensors)


class MoEMLP:
    """x [T, H] -> [T, H]: routed SwiGLU experts (+ an optional gated shared expert)."""

    def __init__(self, router: LinearWeight, experts: ExpertWeights | NativeExperts, top_k: int,
                 renormalize: bool,
                 shared: DenseMLP | None = None, shared_gate: DenseLinear | None = None) -> None:
        self.router = router  # [E, H]
        self.experts = experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.shared = shared
        self.shared_gate = shared_gate  # [1, H]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = self.router(x)  # [T, E]
        topk_weights, topk_ids = kernels.select_experts(router_logits, self.top_k, self.renormalize)
        if isinstance(self.experts, NativeExperts):  # the CPU default path
            out = self.experts(x, topk_weights, topk_ids)  # [T, H]
        elif self.experts.fp8 and kernels.kernel_backend(x.device) == "torch":
            # CPU: dequantize only the experts this step routes to (K of E for one decode token)
            used = torch.unique(topk_ids)  # [E'] sorted
            w13, w2 = self.experts.dense(used)
            topk_ids = torch.searchsorted(used, topk_ids).to(torch.int32)  # ids into the E' experts
            out = kernels.fused_moe(x.contiguous(), w13, w2, topk_weights, topk_ids)  # [T, H]
        else:
            w13, w2 = self.experts.dense()
            out = kernels.fused_moe(x.contiguous(), w13, w2, topk_weights, topk_ids)  # [T, H]
        if self.shared is not None:
            gate = self.shared_gate(x) if self.shared_gate is not None else None  # [T, 1]
            shared = self.shared(x)  # [T, H]
            out = out + (torch.sigmoid(gate) * shared if gate is not None else shared)
        return out


def moe_mlp_factory(config: ModelConfig, weights: Weights, layer: int,
                    make_linear: LinearFactory) -> MoEMLP | DenseMLP:
    """Pop layer `layer`'s MoE weights out of `weights` (HF names) and build its MLP (the dense
    MLP on a layer that is not sparse)."""
    if not config.is_sparse_layer(layer):
        return dense_mlp_factory(config, weights, layer, make_linear)
    p = f"model.layers.{layer}."
    module, gate_name, up_name, down_name = _EXPERT_NAMES[config.architecture]
    num_experts, hidden, inter = (config.num_experts, config.hidden_size,
                                  config.moe_intermediate_size)
    what = f"{config.architecture} layer {layer}"
    if p + "mlp.experts.gate_up_proj" in weights:  # transformers 5 fused experts
        router_weight = take(weights, p + "mlp.gate.weight", (num_experts, hidden), what)
        w13 = take(weights, p + "mlp.experts.gate_up_proj", (num_experts, 2 * inter, hidden))
        w2 = take(weights, p + "mlp.experts.down_proj", (num_experts, hidden, inter))
    else:
        m = f"{p}{module}."
        router_weight = take(weights, m + "gate.weight", (num_experts, hidden), what)
        e = range(num_experts)
        gates = [take(weights, f"{m}experts.{i}.{gate_name}.weight", (inter, hidden), what)
                 for i in e]  # E x [I, H]
        ups = [take(weights, f"{m}experts.{i}.{up_name}.weight", (inter, hidden), what) for i in e]
        downs = [take(weights, f"{m}experts.{i}.{down_name}.weight", (hidden, inter), what)
                 for i in e]  # E x [H, I]
        # [E, I, H] x 2 -> [E, 2I, H]
        w13 = torch.cat([torch.stack(gates), torch.stack(ups)], dim=1)
        w2 = torch.stack(downs)  # [E, H, I]

    # The router goes through make_linear only to learn the engine's device and dtype.
    probe = make_linear(p + "mlp.gate.weight", router_weight)
    device, dtype = probe.device, probe.dtype
    is_fp8 = isinstance(probe, FP8Linear)
    router = float_router(probe, router_weight, device, dtype)  # routers stay float
    experts = build_experts(make_linear, p + "mlp.experts.", w13, w2, device, dtype, fp8=is_fp8)

    shared = shared_gate = None
    s = p + "mlp.shared_expert."
    shared_inter = config.shared_expert_intermediate_size
    if shared_inter and s + "gate_proj.weight" in weights:
        gate_up = fuse_rows([take(weights, s + "gate_proj.weight", (shared_inter, hidden)),
                             take(weights, s + "up_proj.weight", (shared_inter, hidden))])
        shared = DenseMLP(make_linear(s + "gate_up_proj.weight", gate_up),
                          make_linear(s + "down_proj.weight",
                                      take(weights, s + "down_proj.weight",
                                           (hidden, shared_inter))))
        # [1, H]
        gate_weight = take_optional(weights, p + "mlp.shared_expert_gate.weight", (1, hidden))
        shared_gate = (DenseLinear(gate_weight.to(device, dtype)) if gate_weight is not None
                       else None)
    for leftover in [k for k in weights if k.startswith(p + "mlp.shared_expert")]:
        weights.pop(leftover)  # zero-size shared expert (shared_expert_intermediate_size == 0)
    return MoEMLP(router, experts, config.num_experts_per_tok, config.norm_topk_prob, shared,
                  shared_gate)


def float_router(probe: LinearWeight, weight: torch.Tensor, device: torch.device,
                 dtype: torch.dtype) -> LinearWeight:
    """The router as the factory built it when that is a float linear, else (FP8, native blocks)
    a dense float one: top-k is sensitive to small logit errors (llama.cpp keeps routers float
    too)."""
    if isinstance(probe, (DenseLinear, OneDNNLinear)):
        return probe
    placed = weight.to(device, dtype)
    return OneDNNLinear(placed) if OneDNNLinear.is_available(placed) else DenseLinear(placed)


def build_experts(make_linear: LinearFactory, prefix: str, w13: torch.Tensor, w2: torch.Tensor,
                  device: torch.device, dtype: torch.dtype,
                  fp8: bool) -> ExpertWeights | NativeExperts:
    """A layer's experts, w13 [E, 2I, H] and w2 [E, H, I]: native per-expert linears on the CPU
    default path (engine/layers/native_experts.py: the file's blocks or quantized at load), else
    stacked dense / FP8 tensors for the fused MoE."""
    if not fp8 and uses_native_blocks(make_linear):
        native = NativeExperts.build(make_linear, prefix, w13, w2)
        if native is not None:
            return native
    return ExpertWeights(w13.to(device), w2.to(device), dtype, fp8=fp8)


