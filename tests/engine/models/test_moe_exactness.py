"""The default model turned into an MoE whose experts are all copies of its MLP (softmax top-k,
renormalised, random router) computes the dense model's function: same greedy tokens."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from engine.config import ModelConfig
from tests.engine.models._greedy import greedy, make_runner

NUM_EXPERTS = 4
TOP_K = 2
PROMPTS = [[1, 504, 3458, 282, 4649, 314, 216, 1345, 30], [1, 22, 1159, 17, 7734, 28, 5]]


def as_copied_expert_moe(config: ModelConfig, weights: dict[str, torch.Tensor]
                         ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Mixtral config + weights: each layer's MLP copied into every expert (the fused expert layout,
    as stride-0 views: no extra memory) and a random router."""
    moe_config = dataclasses.replace(config, architecture="mixtral", num_experts=NUM_EXPERTS,
                                     num_experts_per_tok=TOP_K,
                                     moe_intermediate_size=config.intermediate_size,
                                     norm_topk_prob=True)
    moe = dict(weights)
    gen = torch.Generator().manual_seed(0)
    for i in range(config.num_layers):
        p = f"model.layers.{i}.mlp."
        # [2I, H]
        gate_up = torch.cat([moe.pop(p + "gate_proj.weight"), moe.pop(p + "up_proj.weight")])
        down = moe.pop(p + "down_proj.weight")  # [H, I]
        moe[p + "experts.gate_up_proj"] = gate_up.expand(NUM_EXPERTS, *gate_up.shape)  # [E, 2I, H]
        moe[p + "experts.down_proj"] = down.expand(NUM_EXPERTS, *down.shape)  # [E, H, I]
        # [E, H]
        moe[p + "gate.weight"] = torch.randn(NUM_EXPERTS, config.hidden_size, generator=gen)
    return moe_config, moe


def test_moe_of_identical_experts_generates_what_the_dense_model_does(
        default_checkpoint: Any) -> None:
    config, weights = default_checkpoint.config, default_checkpoint.weights
    dense_tokens, dense_logits = greedy(make_runner(config, weights), PROMPTS, 16)
    moe_config, moe_weights = as_copied_expert_moe(config, weights)
    moe_tokens, moe_logits = greedy(make_runner(moe_config, moe_weights), PROMPTS, 16)
    assert moe_tokens == dense_tokens
    assert len(set(dense_tokens[0])) > 2
    for moe_rows, dense_rows in zip(moe_logits, dense_logits, strict=True):
        torch.testing.assert_close(moe_rows, dense_rows, rtol=1e-4, atol=1e-3)


def test_moe_with_a_wrong_expert_diverges_from_the_dense_model(default_checkpoint: Any) -> None:
    """The check above can fail: one expert of one layer scaled by 2 changes the logits."""
    config, weights = default_checkpoint.config, default_checkpoint.weights
    moe_config, moe_weights = as_copied_expert_moe(config, weights)
    name = "model.layers.3.mlp.experts.down_proj"
    broken = moe_weights[name].clone()
    broken[1] *= 2.0
    moe_weights[name] = broken
    _, dense_logits = greedy(make_runner(config, weights), PROMPTS[:1], 2)
    _, moe_logits = greedy(make_runner(moe_config, moe_weights), PROMPTS[:1], 2)
    assert not torch.allclose(moe_logits[0], dense_logits[0], rtol=1e-4, atol=1e-3)
