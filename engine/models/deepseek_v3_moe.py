"""DeepSeek-V3's MLP: routed SwiGLU experts with grouped top-k routing, plus always-on shared
experts (dense SwiGLU MLPs on the first `first_k_dense_replace` layers:
`ModelConfig.mlp_only_layers`).

Dimension legend: T tokens, H hidden, E routed experts, K experts per token, N groups (n_group),
I expert intermediate size, S shared-expert size (n_shared_experts * I).

Routing, as transformers' DeepseekV3TopkRouter (noaux_tc), in float32:

    scores  = sigmoid(x @ gate^T)                      [T, E]
    choice  = scores + e_score_correction_bias         the bias steers the choice, not the weights
    group   = sum of each group's two best `choice`    [T, N]; keep the best topk_group groups
    ids     = top-K of `choice` inside the kept groups
    weights = scores[ids] (/ their sum if norm_topk_prob) * routed_scaling_factor
    out     = sum_k weights_k * expert_{ids_k}(x) + shared(x)

Checkpoint names (p = "model.layers.{i}.mlp."): p.gate.weight [E, H], p.gate.e_score_correction_bias
[E], p.experts.{e}.gate_proj/up_proj/down_proj.weight (or transformers 5's fused
p.experts.gate_up_proj [E, 2I, H] / p.experts.down_proj [E, H, I]),
p.shared_experts.gate_proj/up_proj/down_proj.weight. The experts run through
`engine.kernels.fused_moe`, as every MoE family's (engine/models/moe.py).
"""

from __future__ import annotations

import torch

from engine import kernels
from engine.config import GroupedTopK, ModelConfig
from engine.layers.fp8_linear import FP8Linear
from engine.layers.linear import fuse_rows
from engine.layers.native_experts import NativeExperts
from engine.models.llama import DenseMLP, LinearFactory, Weights, dense_mlp_factory
from engine.models.moe import ExpertWeights, build_experts
from engine.models.weights import take


def grouped_topk(router_logits: torch.Tensor, bias: torch.Tensor, top_k: int, routing: GroupedTopK,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] float32, bias [E] -> (weights [T, K] float32, ids [T, K] int32)."""
    num_tokens, num_experts = router_logits.shape
    scores = router_logits.sigmoid()  # [T, E]
    choice = scores + bias  # [T, E]
    # [T, N, E/N]
    per_group = choice.view(num_tokens, routing.n_group, num_experts // routing.n_group)
    group_scores = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(dim=-1)  # [T, N]
    kept = group_scores.topk(routing.topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
    group_mask = torch.zeros_like(group_scores).scatter_(1, kept, 1.0).bool()  # [T, N]
    expert_mask = group_mask.unsqueeze(-1).expand_as(per_group).reshape(num_tokens, num_experts)
    ids = choice.masked_fill(~expert_mask, float("-inf")).topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)  # [T, K]
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.routed_scaling_factor, ids.to(torch.int32)


class DeepseekV3MoE:
    """x [T, H] -> [T, H]: grouped-top-k routed experts + the shared experts."""

    def __init__(self, router: torch.Tensor, bias: torch.Tensor,
                 experts: ExpertWeights | NativeExperts, top_k: int,
                 routing: GroupedTopK, renormalize: bool, shared: DenseMLP | None) -> None:
        self.router = router  # [E, H] float32
        self.bias = bias  # [E] float32
        self.experts = experts
        self.top_k = top_k
        self.routing = routing
        self.renormalize = renormalize
        self.shared = shared

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        logits = x.float() @ self.router.t()  # [T, E] float32, as transformers' router
        weights, ids = grouped_topk(logits, self.bias, self.top_k, self.routing, self.renormalize)
        if isinstance(self.experts, NativeExperts):  # the CPU default path
            out = self.experts(x, weights, ids)  # [T, H]
            return out + self.shared(x) if self.shared is not None else out
        if self.experts.fp8 and kernels.kernel_backend(x.device) == "torch":
            # CPU: dequantize only the routed experts (engine/models/moe.py)
            used = torch.unique(ids)
            w13, w2 = self.experts.dense(used)
            ids = torch.searchsorted(used, ids).to(torch.int32)
        else:
            w13, w2 = self.experts.dense()
        out = kernels.fused_moe(x.contiguous(), w13, w2, weights, ids)  # [T, H]
        return out + self.shared(x) if self.shared is not None else out


def deepseek_v3_mlp(config: ModelConfig, weights: Weights, layer: int,
                    make_linear: LinearFactory) -> DeepseekV3MoE | DenseMLP:
    """Pop layer `layer`'s MLP tensors (HF names) and build it (dense on the first k layers)."""
    if not config.is_sparse_layer(layer):
        return dense_mlp_factory(config, weights, layer, make_linear)
    assert config.grouped_topk is not None
    p, what = f"model.layers.{layer}.mlp.", f"deepseek_v3 layer {layer}"
    num_experts, hidden, inter = (config.num_experts, config.hidden_size,
                                  config.moe_intermediate_size)
    router = take(weights, p + "gate.weight", (num_experts, hidden), what)
    bias = take(weights, p + "gate.e_score_correction_bias", (num_experts,), what)
    if p + "experts.gate_up_proj" in weights:  # transformers 5 fused experts
        w13 = take(weights, p + "experts.gate_up_proj", (num_experts, 2 * inter, hidden))
        w2 = take(weights, p + "experts.down_proj", (num_experts, hidden, inter))
    else:
        def stack(name: str, shape: tuple[int, int]) -> torch.Tensor:
            return torch.stack([take(weights, f"{p}experts.{e}.{name}.weight", shape, what)
                                for e in range(num_experts)])

        w13 = torch.cat([stack("gate_proj", (inter, hidden)), stack("up_proj", (inter, hidden))],
                        dim=1)  # [E, I, H] x 2 -> [E, 2I, H]
        w2 = stack("down_proj", (hidden, inter))  # [E, H, I]
    probe = make_linear(p + "gate.weight", router)  # only to learn the engine's device and dtype
    device, dtype = probe.device, probe.dtype
    experts = build_experts(make_linear, p + "experts.", w13, w2, device, dtype,
                            fp8=isinstance(probe, FP8Linear))
    shared = None
    size, s = config.shared_expert_intermediate_size, p + "shared_experts."
    if size:
        gate_up = fuse_rows([take(weights, s + "gate_proj.weight", (size, hidden), what),
                             take(weights, s + "up_proj.weight", (size, hidden), what)])  # [2S, H]
        shared = DenseMLP(make_linear(s + "gate_up_proj.weight", gate_up),
                          make_linear(s + "down_proj.weight",
                                      take(weights, s + "down_proj.weight", (hidden, size), what)))
    return DeepseekV3MoE(router.to(device, torch.float32), bias.to(device, torch.float32), experts,
                         config.num_experts_per_tok, config.grouped_topk, config.norm_topk_prob,
                         shared)
